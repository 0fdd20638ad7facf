"""The model's shape, read from a Hugging Face `config.json` without transformers' modeling code.

`ModelConfig` is what the rest of the engine needs to know about a model: layer and head counts
(the KV pool shape derives from them), the vocabulary, the stop tokens and the rotary parameters.
Only the Llama family is supported (model_type llama, mistral, qwen2; SmolLM is llama): one
pre-norm decoder layer with RMSNorm, grouped-query attention with rotary embeddings and a SwiGLU
MLP, which differ only in biases and defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_SCALING_TYPES = ("default", "linear", "llama3")

# transformers' per-family defaults for keys that a config.json may leave out.
_DEFAULT_MAX_POSITION = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    `scaling_type` "default" is plain RoPE; "linear" divides every frequency by `factor`; "llama3"
    divides low frequencies by `factor`, keeps high ones, and interpolates in between (Llama 3.1).
    """

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.scaling_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.scaling_type!r} is not one of {ROPE_SCALING_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.scaling_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, "
                f"got {self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and vocabulary of a Llama-family model.

    Attributes:
        name: the model's name (the `model` argument that loaded it, or the directory name).
        model_type: "llama", "mistral" or "qwen2".
        num_layers, num_q_heads, num_kv_heads, head_dim: attention shape; H_q % H_kv == 0.
        hidden_size, intermediate_size, vocab_size: widths of the residual stream, MLP, vocabulary.
        max_position: the longest context the model was trained for.
        rms_norm_eps: epsilon of every RMSNorm.
        rope: rotary embedding parameters.
        eos_token_ids: every token that ends a generation (generation_config, config, tokenizer).
        bos_token_id: the token a prompt starts with, if the model has one.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias (Qwen2: qkv only).
        sliding_window: Mistral/Qwen2 window, recorded but NOT applied: attention is always full.
    """

    name: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        for field in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size",
                      "intermediate_size", "vocab_size", "max_position"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        """Width of the query projection, H_q * D."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection, H_kv * D."""
        return self.num_kv_heads * self.head_dim

    def kv_pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the KV pool this model reads and writes (see docs/design.md)."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_hf(
        cls,
        hf_config: dict[str, Any],
        *,
        name: str,
        generation_config: dict[str, Any] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> ModelConfig:
        """Build from the dicts of `config.json` and `generation_config.json`.

        Raises:
            ValueError: unsupported model_type, activation or rope scaling, or a missing key.
        """
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model {name!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model {name!r} uses hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if hf_config.get(k) is None]
        if missing:
            raise ValueError(f"config.json of model {name!r} lacks {missing}")
        num_q_heads = hf_config["num_attention_heads"]
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_q_heads
        is_qwen2 = model_type == "qwen2"
        window = hf_config.get("sliding_window")
        if is_qwen2 and not hf_config.get("use_sliding_window", False):
            window = None
        eos_ids = _token_ids((generation_config or {}).get("eos_token_id"))
        eos_ids += _token_ids(hf_config.get("eos_token_id")) + tuple(extra_eos_token_ids)
        return cls(
            name=name,
            model_type=model_type,
            num_layers=hf_config["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_q_heads,
            head_dim=head_dim,
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            vocab_size=hf_config["vocab_size"],
            max_position=hf_config.get("max_position_embeddings") or _DEFAULT_MAX_POSITION[model_type],
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf_config, name),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),  # de-duplicated, order kept
            bos_token_id=(generation_config or {}).get("bos_token_id", hf_config.get("bos_token_id")),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (and none on o_proj); Llama has attention_bias on all four.
            qkv_bias=is_qwen2 or bool(hf_config.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(hf_config.get("attention_bias", False)),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            sliding_window=window,
        )

    @classmethod
    def from_dir(cls, path: Path, *, name: str, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` if present) from a model directory."""
        hf_config = json.loads((path / "config.json").read_text())
        generation_path = path / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_hf(hf_config, name=name, generation_config=generation,
                           extra_eos_token_ids=extra_eos_token_ids)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _rope_config(hf_config: dict[str, Any], name: str) -> RopeConfig:
    """Rope parameters from either the transformers 5 `rope_parameters` dict or the older
    top-level `rope_theta` plus `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    scaling_type = params.get("rope_type", params.get("type", "default"))
    if scaling_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"model {name!r} uses rope scaling {scaling_type!r}; supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"model {name!r} uses partial rotary embeddings, which are not supported")
    return RopeConfig(
        theta=float(theta),
        scaling_type=scaling_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
