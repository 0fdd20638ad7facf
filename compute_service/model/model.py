"""Our own Llama-family forward pass over a packed batch and a paged KV pool.

No transformers modeling code runs here: weights come in as (Hugging Face name, tensor) pairs
and are copied into fused parameters by name. The KV pool is not ours: it is the memory
service's allocation, mapped into this process, shape
(num_layers, 2, num_blocks, block_size, H_kv, D); the model only reads and writes its slots.

Mistral's and Qwen2's sliding window is not applied: attention always spans the whole context,
which equals the trained model only for contexts shorter than the window (the loader logs it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from compute_service.model.forward_batch import ForwardBatch
from compute_service.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding, empty_parameter, profile_scope
from compute_service.model.model_config import ModelConfig
import pagedserve_kernels as kernels
from pagedserve_kernels.quant import (INT4_GROUP, QuantizedLinear, int8_group, pack, quantize_linear, stack_operands,
                                      supports)
from pagedserve_kernels.quant import release_scratch as release_quant_scratch
from pagedserve_kernels.quant import tiles as quant_tiles
from compute_service.model.gguf_quant import FileQuantization, MappedRows

# Buffers that some checkpoints carry but that we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module):
    """A Llama/Mistral/Qwen2 decoder that returns next-token logits of each sequence's last token."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = empty_parameter(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, device=device, dtype=dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, device=device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else empty_parameter(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        )
        self.lm_head_packed: torch.Tensor | None = None  # see prepack_cpu_weights
        self.lm_head_small: torch.Tensor | None = None  # the head's copy for the small-batch kernel (AMX tiles)
        self._layer_stack: kernels.LayerStack | None = None  # see layer_stack
        # The embedding table kept quantized (quantize_weights): packed, or read in place from the file.
        self.embed_quantized: QuantizedLinear | MappedRows | None = None
        self.quantization = "none"  # what quantize_weights did ("int4", "Q4_K+Q6_K"), for the logs and Info
        self.small_rows = 0  # see prepack_cpu_weights

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the weights, the linears' inputs and outputs, and the KV pool (the residual stream is float32)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor, logits_rows: torch.Tensor | None = None,
                hidden_rows: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step: write the new tokens' K/V into the pool and score the next token.

        Args:
            batch: T new tokens of B sequences, packed (see ForwardBatch).
            kv_pool: (num_layers, 2, num_blocks, block_size, H_kv, D), the model's dtype and device;
                every token of each sequence before its new ones must already be in it.
            logits_rows: (R,) int64 rows of the batch to score (speculative drafts need several
                per sequence); None = each sequence's last row.
            hidden_rows: (P,) int64 rows whose final (normed) hidden states to return as well, for
                the caller to score with ``compute_logits`` a slice at a time (prompt logprobs need
                every prompt position: their (P, vocab) logits at once would be large).
        Returns:
            (B, vocab_size) float32 logits of the token after each sequence's last new token, or
            (R, vocab_size) after each of ``logits_rows``; with ``hidden_rows``, also their (P, hidden).
        """
        self.check_kv_pool(kv_pool)
        # The residual stream is float32 whatever the weights' dtype (llama.cpp's CPU backend keeps its
        # activations so too): in bfloat16 its 30 layers of rounded adds flipped near-tied greedy answers,
        # the README's own question among them. Linears still read bf16 (each norm rounds
        # its output to the weights' dtype once) and the KV cache stays in the model's dtype.
        if self.embed_quantized is not None:
            hidden = self.embed_quantized.rows(batch.input_ids)  # (T, hidden) float32
        else:
            hidden = F.embedding(batch.input_ids, self.embed_tokens).float()  # (T, hidden) float32
        with profile_scope("rotary"):
            cos, sin = self.rotary(batch.positions)  # (T, D) each
        # (B,) rows of the last tokens (or the (R,) rows asked for): only they need logits; None when
        # every row is a sequence's last (a decode step without drafts).
        if logits_rows is not None:
            last_rows = logits_rows
        else:
            last_rows = None if batch.num_tokens == batch.num_seqs else batch.cu_seqlens_q[1:].long() - 1
        step = kernels.plan_step(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
                                 dtype=self.dtype, head_dim=self.config.head_dim)
        # Each layer's MLP output, added to the residual inside the next layer's first norm: every layer
        # in one call where the step's kernels can, else layer by layer (the same ops either way).
        pending = step.run_layers(hidden, cos, sin, kv_pool, self.layer_stack())
        if pending is None:
            for layer_id, layer in enumerate(self.layers):
                hidden, pending = layer(hidden, pending, cos, sin, kv_pool[layer_id, 0], kv_pool[layer_id, 1], step)
        last = hidden + pending if last_rows is None else hidden[last_rows] + pending[last_rows]  # (B, hidden)
        logits = self.compute_logits(self.norm(last))
        if hidden_rows is None:
            return logits
        return logits, self.norm(hidden[hidden_rows] + pending[hidden_rows])  # (P, hidden)

    def layer_stack(self) -> kernels.LayerStack:
        """The layers' weights as `StepKernels.run_layers` takes them (built once; again after prepacking)."""
        if self._layer_stack is None:
            weights, packed, biases = [], [], []
            for layer in self.layers:
                attn, mlp = layer.attn, layer.mlp
                weights += [layer.input_norm.weight, attn.qkv_weight, attn.o_weight, layer.post_attn_norm.weight,
                            mlp.gate_up_weight, mlp.down_weight]
                packed += [attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed]
                biases += [attn.qkv_bias, attn.o_bias, mlp.gate_up_bias, mlp.down_bias]
            config = self.config
            quantized = any(isinstance(p, QuantizedLinear) for p in packed)
            quant, quant_meta = stack_operands(packed) if quantized else ([], [])
            packed = [p if isinstance(p, torch.Tensor) else None for p in packed]  # quantized ones travel in `quant`
            self._layer_stack = kernels.LayerStack(weights, packed, biases, self.small_rows, config.num_q_heads,
                                                   config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                                   config.head_dim**-0.5, quantized, quant, quant_meta,
                                                   quantized and quant_tiles())
        return self._layer_stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) final normed hidden states -> (N, vocab_size) float32 logits (the LM head)."""
        with profile_scope("lm_head"):
            return kernels.logits(hidden, self.lm_head, self.lm_head_packed, self.small_rows, self.lm_head_small)

    def check_kv_pool(self, kv_pool: torch.Tensor) -> None:
        """Raise ValueError unless `kv_pool` has this model's layout, dtype and device."""
        config = self.config
        expected = (config.num_layers, 2, config.num_kv_heads, config.head_dim)
        shape = tuple(kv_pool.shape)
        if kv_pool.dim() != 6 or (shape[0], shape[1], shape[4], shape[5]) != expected:
            raise ValueError(
                f"kv_pool must be ({config.num_layers}, 2, num_blocks, block_size, "
                f"{config.num_kv_heads}, {config.head_dim}) for model {config.name!r}, got {shape}"
            )
        if kv_pool.dtype != self.dtype or kv_pool.device != self.device:
            raise ValueError(
                f"kv_pool is {kv_pool.dtype} on {kv_pool.device}; the model is {self.dtype} on {self.device}"
            )

    @torch.no_grad()
    def prepack_cpu_weights(self) -> bool:
        """Reorder every projection and the head for oneDNN's matmul (kernels/pagedserve_kernels/cpu_linear.py), once,
        after the weights are loaded; returns False, changing nothing, off a float32 or bfloat16 CPU model.

        The plain copies of the layers' projections are released (their packed copies replace them:
        the weights are not held twice), except where the small-batch kernel reads them (bfloat16
        decode, `kernels.keeps_plain`, while that copy fits the machine's free memory: on an AMX CPU
        in the tiles' layout, `kernels.small_weight`); the head keeps its plain copy, which may be the
        embedding table, and on an AMX CPU a third one for the small-batch kernel. A packed model
        cannot load weights again: load a new one.
        """
        if self.device.type != "cpu":
            return False
        self._set_small_rows(kernels.small_rows(self.dtype))  # plain weights take it, packed or not
        if self.dtype not in kernels.PACKED_DTYPES or not kernels.can_prepack():
            return False
        plain_bytes = sum(getattr(m, f"{n}_weight").nbytes for m, n in self._projections())
        keep_plain = kernels.keeps_plain(self.dtype, plain_bytes)  # (a released weight: oneDNN's, any rows)
        for module, name in self._projections():
            weight = getattr(module, f"{name}_weight")
            if isinstance(getattr(module, f"{name}_packed"), QuantizedLinear):
                continue  # kept quantized (quantize_weights)
            packed = kernels.prepack(weight)
            if packed is not None:
                setattr(module, f"{name}_packed", packed)
                # Kept for the small-batch kernel, in its layout (AMX tiles: the same bytes), or released.
                weight.data = kernels.small_weight(weight) if keep_plain else torch.empty(0, dtype=weight.dtype,
                                                                                          device=weight.device)
        if isinstance(self.lm_head_packed, QuantizedLinear):
            self._layer_stack = None
            return True
        self.lm_head_packed = kernels.prepack(self.lm_head, calibrate=False)
        if self.small_rows and keep_plain:  # the third copy of the head only where the plain ones fit
            small = kernels.small_weight(self.lm_head)
            self.lm_head_small = small if small is not self.lm_head else None
        self._layer_stack = None  # the packed copies join (or replace) the weights
        return self.is_prepacked

    def release_scratch(self) -> None:
        """Hand back what the quantized kernels keep from call to call on this thread (a prompt's int8
        activations: tens of MB); the engine loop calls it when idle, the next prompt takes it again."""
        if self.quantization != "none" and self.device.type == "cpu":
            release_quant_scratch()

    @torch.no_grad()
    def quantize_weights(self, scheme: str,
                         file_weights: Mapping[str, FileQuantization | MappedRows] | None = None) -> str:
        """Keep the projections and the head as 8-, 6- or 4-bit integers (kernels/pagedserve_kernels/quant.py),
        once, after the weights are loaded and before `prepack_cpu_weights`; their float copies are released.

        Args:
            scheme: "int8" or "int4": quantize the loaded weights (the head at int8 either way: its
                rounding decides near-tied greedy answers); "file": take `file_weights` as they are.
            file_weights: Hugging Face name -> the integers and scales of a GGUF's own blocks
                (compute_service/model/gguf_quant.py). A projection whose pieces the file does not all
                hold quantized stays in the model's dtype; so does the head, and the embedding table
                where the file holds it in floats. An embedding table given as `MappedRows` (read in
                place from the file) is looked up as it is.
        Returns:
            What was done, for the logs and the fingerprint: the formats held, sorted ("int4+int8",
            "Q4_K+Q6_K"), or "none".
        """
        if self.device.type != "cpu" or self.is_prepacked:
            raise ValueError("quantized weights need a CPU model, quantized before prepack_cpu_weights")
        pieces = self._hf_pieces()
        labels: set[str] = set()
        for module, name in self._projections():
            weight, bias = getattr(module, f"{name}_weight"), getattr(module, f"{name}_bias")
            if scheme == "file":
                quantized = _from_file(pieces[id(weight)], file_weights or {}, bias)
            elif supports(weight.shape, *((8, int8_group(weight.shape[1])) if scheme == "int8" else (4, INT4_GROUP))):
                quantized = quantize_linear(weight, bias, scheme)
            else:  # e.g. inputs not in whole groups: this projection stays in the dtype
                quantized = None
            if quantized is not None:
                setattr(module, f"{name}_packed", quantized)
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
                labels.update(quantized.label.split("+"))
        if scheme == "file":
            embed = (file_weights or {}).get("model.embed_tokens.weight")
            if not isinstance(embed, MappedRows):  # read in place where it is (model_loader: untied)
                embed = _from_file([("model.embed_tokens.weight", 0, self.config.vocab_size)], file_weights or {},
                                   None)
            head = embed if self.config.tie_word_embeddings else _from_file(
                [("lm_head.weight", 0, self.config.vocab_size)], file_weights or {}, None)
        else:
            embed, head = None, quantize_linear(self.lm_head, None, "int8")
        if head is not None:
            self.lm_head_packed = head
            labels.update(head.label.split("+"))
            if not self.config.tie_word_embeddings:
                self.lm_head.data = torch.empty(0, dtype=self.dtype, device=self.device)
        if embed is not None:
            self.embed_quantized = embed
            self.embed_tokens.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self._layer_stack = None
        self.quantization = "+".join(sorted(labels)) or "none"
        return self.quantization

    def file_quantized_names(self, file_weights: Mapping[str, FileQuantization]) -> frozenset[str]:
        """The Hugging Face names `quantize_weights("file", file_weights)` replaces: every piece of each
        projection the file holds wholly quantized, the embedding table and the head where it holds
        them so (their float copies need not be loaded at all)."""
        names = {name for pieces in self._hf_pieces().values() if all(p[0] in file_weights for p in pieces)
                 for name, _, _ in pieces}
        return frozenset(names | ({"model.embed_tokens.weight", "lm_head.weight"} & set(file_weights)))

    def _hf_pieces(self) -> dict[int, list[tuple[str, int, int]]]:
        """id(fused weight) -> its (Hugging Face name, first row, end row) pieces in row order."""
        pieces: dict[int, list[tuple[str, int, int]]] = {}
        for hf_name, (param, start, stop) in self._hf_targets().items():
            if hf_name.endswith(".weight"):
                pieces.setdefault(id(param), []).append((hf_name, start, stop))
        return {key: sorted(value, key=lambda piece: piece[1]) for key, value in pieces.items()}

    def _set_small_rows(self, num_rows: int) -> None:
        """Steps of up to ``num_rows`` rows run the small-batch linear (kernels/pagedserve_kernels/cpu_linear.py)."""
        self.small_rows = num_rows
        for layer in self.layers:
            layer.attn.small_rows = layer.mlp.small_rows = num_rows
        self._layer_stack = None

    @property
    def is_prepacked(self) -> bool:
        """Whether any weight was replaced by its packed copy (then the model cannot load weights)."""
        return self.lm_head_packed is not None or any(
            getattr(module, f"{name}_packed") is not None for module, name in self._projections()
        )

    def _projections(self) -> Iterable[tuple[nn.Module, str]]:
        """(module, name) of every layer's projection: its weight is ``module.<name>_weight``."""
        for layer in self.layers:
            yield from ((layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down"))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], skip: frozenset[str] = frozenset()) -> None:
        """Copy a Hugging Face state dict into the fused parameters, casting to the model dtype.

        Args:
            weights: (name, tensor) pairs in Hugging Face naming ("model.layers.3.mlp.up_proj.weight").
            skip: names left unloaded (not even read), counted as loaded: the caller replaces them next
                (`quantize_weights("file", ...)` with `file_quantized_names`'s names).
        Raises:
            ValueError: an unknown name, a wrong shape, or a parameter that was never loaded (an
                uninitialised parameter would silently produce garbage).
        """
        if self.is_prepacked:
            raise ValueError("this model's weights are prepacked for the CPU; load a new model instead")
        targets = self._hf_targets()
        loaded: set[str] = set(skip)
        for name, tensor in weights:
            if name in skip:
                continue
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # a tied head is the embedding matrix; some checkpoints store it twice
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no place in a {self.config.model_type} model")
            param, start, stop = targets[name]
            destination = param[start:stop]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} is {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def _hf_targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Hugging Face tensor name -> (our parameter, first row, end row) it fills."""
        config = self.config
        q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
        targets: dict[str, tuple[nn.Parameter, int, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, config.vocab_size),
            "model.norm.weight": (self.norm.weight, 0, config.hidden_size),
        }
        if not config.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0, config.vocab_size)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.attn, layer.mlp
            fused = {
                "self_attn.q_proj": (attn.qkv_weight, attn.qkv_bias, 0, q),
                "self_attn.k_proj": (attn.qkv_weight, attn.qkv_bias, q, q + kv),
                "self_attn.v_proj": (attn.qkv_weight, attn.qkv_bias, q + kv, q + 2 * kv),
                "self_attn.o_proj": (attn.o_weight, attn.o_bias, 0, config.hidden_size),
                "mlp.gate_proj": (mlp.gate_up_weight, mlp.gate_up_bias, 0, inter),
                "mlp.up_proj": (mlp.gate_up_weight, mlp.gate_up_bias, inter, 2 * inter),
                "mlp.down_proj": (mlp.down_weight, mlp.down_bias, 0, config.hidden_size),
            }
            prefix = f"model.layers.{i}."
            for hf_name, (weight, bias, start, stop) in fused.items():
                targets[f"{prefix}{hf_name}.weight"] = (weight, start, stop)
                if bias is not None:
                    targets[f"{prefix}{hf_name}.bias"] = (bias, start, stop)
            targets[f"{prefix}input_layernorm.weight"] = (layer.input_norm.weight, 0, config.hidden_size)
            targets[f"{prefix}post_attention_layernorm.weight"] = (layer.post_attn_norm.weight, 0, config.hidden_size)
        return targets


def _from_file(pieces: list[tuple[str, int, int]], file_weights: Mapping[str, FileQuantization],
               bias: torch.Tensor | None) -> QuantizedLinear | None:
    """A fused projection from its pieces' file blocks: consecutive pieces of one format (width, group,
    with or without mins) share a part. None unless the file holds every piece quantized."""
    found = [file_weights.get(name) for name, _, _ in pieces]
    if not pieces or any(f is None for f in found):
        return None
    parts = []
    for _, run in itertools.groupby(zip(found, pieces), key=lambda item: _format(item[0])):
        run = list(run)
        quants = [quant for quant, _ in run]

        try:
            part = pack(torch.cat([q.q for q in quants]), torch.cat([q.scale for q in quants]),
                        _joined(quants, "minimum"), quants[0].bits, _joined(quants, "scale_factor"),
                        _joined(quants, "min_factor"))
        except ValueError as error:
            raise ValueError(f"GGUF tensor(s) {[name for name, _, _ in pieces]}: {error}") from None
        first, last = run[0][1], run[-1][1]
        parts.append(part.with_bias(None if bias is None else bias[first[1]:last[2]]))
    label = "+".join(dict.fromkeys(quant.type_name for quant in found))
    return QuantizedLinear(tuple(parts), label)


def _joined(quants: list[FileQuantization], field: str) -> torch.Tensor | None:
    """The pieces' rows of an optional field, concatenated; None unless every piece has it."""
    values = [getattr(quant, field) for quant in quants]
    return None if any(value is None for value in values) else torch.cat(values)


def _format(quant: FileQuantization) -> tuple[int, int, bool]:
    """What decides whether two pieces can share a packed part: bits, inputs per group, mins or not (a
    run that mixes K-quants with other types holds float16 scales: `_joined` gives no factors)."""
    return quant.bits, quant.q.shape[1] // quant.scale.shape[1], quant.minimum is None
