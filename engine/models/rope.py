"""Rotary position embeddings, neox style (``rotate_half``) like HF Llama.

The model computes ``cos, sin = rotary(positions, dtype=...)`` once per step and every attention layer
calls ``apply_rotary_qk(q, k, cos, sin)``. Inverse frequencies follow the formulas of
transformers' ``modeling_rope_utils`` for the types in ``ROPE_TYPES`` (same float32 arithmetic,
so the tiny-model tests match HF to rounding); cos/sin are computed in float32 and cast to the
activations' dtype, as HF does: once per eager step (``dtype``), not once per layer and tensor (the
compiled CPU pieces take them in float32 and cast inside their graph, as they were warmed up).
``apply_rotary_qk`` rotates q and k in place with one Triton kernel where ``kernels/fused_ops.py``'s switch
says so (CUDA by default), else calls ``apply_rotary`` on each (the C kernel for float32 on CPU, else torch).

"dynamic" (NTK) rescales the base by the sequence length seen so far: HF uses the largest
position of the current forward call + 1, so the model passes ``seq_lens`` per row (a prefill
row: its sequence's last new position + 1; a decode row: its own position + 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.models.model_config import RopeConfig
from pdserve.kernels import cpu_ops, fused_ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int):
        super().__init__()
        self.head_dim, self.rope, self.max_positions = head_dim, rope, max_position_embeddings
        inv_freq, self.attention_scaling = inv_frequencies(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)     # [D/2] float32

    @property
    def dynamic(self) -> bool:
        return self.rope.rope_type == "dynamic"

    def forward(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                dtype: torch.dtype | None = None):
        """positions: [T] -> cos, sin: [T, D] (already scaled by the attention factor), computed in float32 and
        cast to ``dtype`` where given (the model: the activations' dtype, once per step)."""
        cos, sin = self._float32(positions, seq_lens)
        return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))

    def _float32(self, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        # positions: [T] -> cos, sin: [T, D] float32
        inv_freq = self.inv_freq                                          # [D/2]
        if self.dynamic:
            inv_freq = self._dynamic_inv_freq(positions + 1 if seq_lens is None else seq_lens)
        freqs = positions.float().unsqueeze(-1) * inv_freq                # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [T, D]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _dynamic_inv_freq(self, seq_len: torch.Tensor) -> torch.Tensor:
        # seq_len: [T] int64. Rows with L > max_pos:
        #   base' = base * (factor * L / max_pos - (factor - 1)) ** (D / (D - 2))
        # other rows keep the plain frequencies (HF only recomputes past max_pos)
        dim, factor = self.head_dim, self.rope.factor
        scale = (factor * seq_len / self.max_positions) - (factor - 1)
        base = self.rope.theta * scale ** (dim / (dim - 2))                        # [T] float32
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim       # [D/2]
        stretched = 1.0 / (base.unsqueeze(-1) ** exponents)                        # [T, D/2]
        return torch.where((seq_len > self.max_positions).unsqueeze(-1), stretched, self.inv_freq)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, H, D], k: [T, Hkv, D] -> (q, k) rotated: in place by one Triton kernel where
    ``fused_ops.rope_on`` (CUDA by default; the torch path's bits), else ``apply_rotary`` of each (new tensors).
    Called by ``llama.Attention.project``."""
    if fused_ops.rope_on(q):
        fused_ops.rotary_qk(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] -> [T, H, D] in x's dtype. Float32 on CPU, outside torch.compile: one
    C call (``kernels/cpu_ops.c``, the same bits as the expression below)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        out = cpu_ops.rotary(x, cos, sin)
        if out is not None:
            return out
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] whose rotary pairs are interleaved, (x0, x1), (x2, x3), ... (DeepSeek's checkpoints); cos, sin:
    [T, D] as ``RotaryEmbedding`` makes them (two copies of the D/2 angles) -> [T, H, D], the rotated pairs written
    de-interleaved: all first members, then all second members (transformers' DeepSeek-V3 layout). q and k go
    through the same permutation, so their dot products are those of the interleaved rotation. Called by
    ``mla.MLAAttention``."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inv_frequencies(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32, attention scaling applied to cos and sin)."""
    kind = rope.rope_type
    if kind in ("default", "dynamic"):      # dynamic at init: seq_len = max_positions -> plain base
        return _base_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(rope, dim), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_positions)
    raise ValueError(f"rope type {kind!r} has no implementation here")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta ** exponents)


def _llama3(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between."""
    original = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_positions / original
    low, high = _yarn_correction_range(rope, dim, original)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp                                      # [D/2]
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, _yarn_attention_factor(rope, factor)


def _yarn_correction_range(rope: RopeConfig, dim: int, original: int) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:     # dimension that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast or 32), dim_for(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_factor(rope: RopeConfig, factor: float) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
    return mscale(factor)
