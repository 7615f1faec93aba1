"""RMSNorm (+ residual add) and rotary embedding: the switch between the Triton kernels and torch.

Who calls what:

    engine.models.layers.RMSNorm.forward / add_norm -> norm_on(x), rms_norm(x, w, eps[, residual])
    engine.models.rope.apply_rotary_qk              -> rope_on(q), rotary_qk(q, k, cos, sin)
    engine.models.llama.LlamaForCausalLM.forward    -> norm_on(h): carry each residual add into the next norm
    tests, devbench/fused_bench.py                  -> the torch references below, the kernels

The switches (``envs.PDSERVE_FUSED_NORM`` / ``PDSERVE_FUSED_ROPE``, read once into ``NORM`` / ``ROPE``, which
tests may set): ``auto`` (the default) runs the kernels on CUDA tensors only -- the CPU path (the C kernels,
torch) is untouched; ``0`` never (the torch path everywhere; for a GPU where ``devbench/fused_bench.py`` finds
the kernels slower); ``1`` everywhere, CPU tensors too, which only runs under ``TRITON_INTERPRET=1`` (tests of
the CUDA path on a CPU). Never inside torch.compile (the compiled CPU pieces keep their own graph).
The Triton modules are imported on first use only.
"""

from __future__ import annotations

import os

import torch

from pdserve.engine import envs

NORM = envs.PDSERVE_FUSED_NORM
ROPE = envs.PDSERVE_FUSED_ROPE


def norm_on(x: torch.Tensor) -> bool:
    """Whether ``RMSNorm`` runs ``x`` through the Triton kernel (and the model fuses its residual adds)."""
    return _on(NORM, "PDSERVE_FUSED_NORM", x)


def rope_on(x: torch.Tensor) -> bool:
    """Whether ``apply_rotary_qk`` rotates ``x`` (q) and k in place with the Triton kernel."""
    return _on(ROPE, "PDSERVE_FUSED_ROPE", x)


def _on(mode: str, name: str, x: torch.Tensor) -> bool:
    if mode == "0" or torch.compiler.is_compiling():
        return False
    if x.device.type == "cuda":
        return True
    if mode == "1" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name}=1 on a CPU tensor runs only under TRITON_INTERPRET=1 (tests); use auto")
    return mode == "1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The Triton RMSNorm (``triton_norm``): y, or (y, residual + x). Rows it cannot take (over its width,
    a strided last dim) go to ``rms_norm_ref``."""
    from pdserve.kernels import triton_norm

    if x.stride(-1) != 1 or x.shape[-1] > triton_norm.MAX_BLOCK or x.dim() not in (2, 3):
        return rms_norm_ref(x, weight, eps, residual)
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1):
        return rms_norm_ref(x, weight, eps, residual)
    return triton_norm.rms_norm(x, weight, eps, residual)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The Triton rotary embedding (``triton_rope``): q and k rotated in place."""
    from pdserve.kernels import triton_rope

    triton_rope.rotary_qk(q, k, cos, sin)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The torch path (HF's): normalise in float32, cast back, times the weight; with ``residual`` first
    s = residual + x in the activations' dtype -> (norm(s), s)."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    return y if residual is None else (y, x)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch path: x [T, H, D] * cos + rotate_half(x) * sin, cos/sin [T, D] cast to x's dtype."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
