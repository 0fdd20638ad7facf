"""Building blocks of a Llama-family decoder layer over a packed batch of T tokens.

Weights are plain `nn.Parameter`s created with `torch.empty` (no initialisation cost: the loader
overwrites every one of them and checks that it did). Projections that read the same input are
fused into one matrix: q/k/v into `qkv_weight` rows [q | k | v], gate/up into `gate_up_weight`
rows [gate | up], so each is one GEMM.

Each step carries the kernels it runs (`kernels.plan_step`: the fused CPU kernels or PyTorch ops,
chosen once per step behind one interface, kernels/pagedserve_kernels/step.py); the layers only call them. Each
residual add runs inside the RMSNorm that follows it (`StepKernels.add_rms_norm`): a layer returns
its residual stream and its MLP output unadded, and the next layer's first norm adds them.

`profile_scope(name)` labels the parts of a step for `torch.profiler` (bench_throughput.py
--profile) while a profiler records, and is a no-op otherwise (one ~70 ns check): no switch to flip.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from compute_service.model.model_config import ModelConfig, RopeConfig
from pagedserve_kernels import StepKernels, linear
from pagedserve_kernels.step import rms_norm_torch

def profile_scope(name: str) -> contextlib.AbstractContextManager:
    """A `torch.profiler.record_function(name)` while a profiler records, else a no-op (a
    record_function costs a dispatcher call even with no profiler running)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def empty_parameter(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter (inference only)."""
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32 whatever the model dtype."""

    def __init__(self, size: int, eps: float, *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, H)"""
        with profile_scope("norm"):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequency of each rotary pair, (D/2,) float32, after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (D/2,)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        # Wavelengths longer than the original context (low frequencies) are stretched by
        # `factor`; short ones are kept; the band in between is interpolated linearly in
        # (context / wavelength), so the spectrum stays continuous.
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, interpolated, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, computed per step (T x D/2 products, no cap on the
    position, no table to keep in sync with the context length)."""

    def __init__(self, head_dim: int, rope: RopeConfig, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin, each (T, D) float32, halves repeated as [f | f]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache of one layer."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_q_heads, self.num_kv_heads = config.num_q_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        qkv_rows = config.q_size + 2 * config.kv_size
        self.qkv_weight = empty_parameter(qkv_rows, config.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = empty_parameter(qkv_rows, device=device, dtype=dtype) if config.qkv_bias else None
        self.o_weight = empty_parameter(config.hidden_size, config.q_size, device=device, dtype=dtype)
        self.o_bias = empty_parameter(config.hidden_size, device=device, dtype=dtype) if config.o_bias else None
        # oneDNN copies of the weights (CausalLM.prepack_cpu_weights); None: F.linear on the weights.
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None
        self.small_rows = 0  # up to this many rows: the small-batch linear (kernels/pagedserve_kernels/cpu_linear.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, step: StepKernels) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes the new tokens' K/V into k_cache/v_cache first."""
        num_tokens = x.shape[0]
        with profile_scope("qkv_proj"):
            # (T, (H_q + 2 H_kv) D); float32 where the small-batch kernel runs (decode): q and k are
            # rounded to the model's dtype once, after the rotation, not before and after it.
            qkv = linear(x, self.qkv_weight, self.qkv_packed, self.qkv_bias, self.small_rows, float_out=True)
        with profile_scope("rotary"):
            q, k, v = step.rotary(qkv, cos, sin, self.num_q_heads, self.num_kv_heads, self.head_dim)
            if qkv.dtype != x.dtype:
                q, k, v = q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)
        with profile_scope("attention"):
            out = step.write_and_attend(q, k, v, k_cache, v_cache, self.scale)  # (T, H_q, D)
        with profile_scope("o_proj"):
            # float32 where the small-batch kernel runs: it is added to the float32 residual stream
            return linear(out.reshape(num_tokens, self.q_size), self.o_weight, self.o_packed, self.o_bias,
                          self.small_rows, float_out=True)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_weight = empty_parameter(2 * inter, hidden, device=device, dtype=dtype)
        self.gate_up_bias = empty_parameter(2 * inter, device=device, dtype=dtype) if config.mlp_bias else None
        self.down_weight = empty_parameter(hidden, inter, device=device, dtype=dtype)
        self.down_bias = empty_parameter(hidden, device=device, dtype=dtype) if config.mlp_bias else None
        self.gate_up_packed: torch.Tensor | None = None  # see Attention.qkv_packed
        self.down_packed: torch.Tensor | None = None
        self.small_rows = 0  # see Attention.small_rows

    def forward(self, x: torch.Tensor, step: StepKernels) -> torch.Tensor:
        """(T, hidden) -> (T, hidden)"""
        with profile_scope("mlp_gate_up"):
            # (T, 2I) [gate | up]
            gate_up = linear(x, self.gate_up_weight, self.gate_up_packed, self.gate_up_bias, self.small_rows)
        with profile_scope("silu_mul"):
            act = step.silu_mul(gate_up)  # (T, I)
        with profile_scope("mlp_down"):
            return linear(act, self.down_weight, self.down_packed, self.down_bias, self.small_rows, float_out=True)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.attn = Attention(config, device=device, dtype=dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(config, device=device, dtype=dtype)

    def forward(self, residual: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepKernels) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is ``residual + pending`` (the previous layer's MLP output, not added
        yet, so that the add runs inside this layer's first RMSNorm).

        Args:
            residual: (T, hidden) contiguous float32 (the residual stream); updated in place.
            pending: (T, hidden) or None (first layer).
        Returns:
            (residual, mlp_out): the layer's output is their sum.
        """
        with profile_scope("norm"):
            if pending is None:
                normed = step.rms_norm(residual, self.input_norm.weight, self.input_norm.eps)
            else:
                normed = step.add_rms_norm(residual, pending, self.input_norm.weight, self.input_norm.eps)
        attn_out = self.attn(normed, cos, sin, k_cache, v_cache, step)
        with profile_scope("norm"):
            normed = step.add_rms_norm(residual, attn_out, self.post_attn_norm.weight, self.post_attn_norm.eps)
        return residual, self.mlp(normed, step)
