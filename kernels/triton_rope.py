"""Triton rotary embedding (neox style), applied to q and k in place in one launch.

Called by ``fused_ops.rotary_qk`` (itself called by ``engine.models.rope.apply_rotary_qk``) on the CUDA path:

    rotary_qk(q, k, cos, sin)       q: [T, H, D], k: [T, Hkv, D] (views of the qkv output: any token/head
                                    strides, unit-stride D), cos, sin: [T, D]; q and k are overwritten

The bits of the torch path, ``x * cos + rotate_half(x) * sin`` with cos/sin cast to x's dtype and each
product and the sum rounded to it (``fused_ops.rotary_ref``), without ``rotate_half``'s ``torch.cat``: with
x = [x1, x2] (halves), out = [x1*c1 - x2*s1, x2*c2 + x1*s2] (``a + (-b)`` is ``a - b`` exactly). Each product
is rounded before the add: the launch turns off FMA contraction (``enable_fp_fusion=False``), which would
otherwise round ``x1*c1 - x2*s1`` once instead of twice -- in bf16 too, where Triton turns the float32
product-and-cast into ``mul.bf16`` and then the subtraction into ``fma.rn.bf16`` (tests/test_fused_ops.py
compiles the kernel for sm_90 and finds no ``fma`` in its PTX).

Grid: one program per token; it loads that token's cos/sin halves once and rotates all q heads, then all
k heads, each as a [heads, D/2] tile (both rounded up to powers of two, the tails masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _rotate(x_ptr, t, H, x_t, x_h, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """Rotate token t's [H, 2*HALF] row of x in place; c1.. are [1, BLOCK_D] float32 tiles."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < H) & (d < HALF)
    p1 = x_ptr + t * x_t + h * x_h + d
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (f1 * c1).to(dt).to(tl.float32) - (f2 * s1).to(dt).to(tl.float32)
    o2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=ok)
    tl.store(p1 + HALF, o2.to(dt), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, HQ, HK, q_t, q_h, k_t, k_h, c_t, s_t,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = d < HALF
    dt = q_ptr.dtype.element_ty                    # cos/sin rounded to the activations' dtype, like torch's
    c1 = tl.load(cos_ptr + t * c_t + d, mask=ok, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + t * c_t + HALF + d, mask=ok, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + t * s_t + d, mask=ok, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + t * s_t + HALF + d, mask=ok, other=0.0).to(dt).to(tl.float32)
    _rotate(q_ptr, t, HQ, q_t, q_h, c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D)
    _rotate(k_ptr, t, HK, k_t, k_h, c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos, sin [T, D] (any float dtype)."""
    _check(q, k, cos, sin)
    if q.shape[0]:
        kernel, grid, args, kwargs = launch(q, k, cos, sin)
        kernel[grid](*args, **kwargs)


def launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(kernel, grid, args, kwargs) of one rotation: ``rotary_qk`` runs it, ``offline_compile.py`` builds it."""
    T, hq, d = q.shape
    half = d // 2
    block_hq, block_hk = triton.next_power_of_2(hq), triton.next_power_of_2(k.shape[1])
    block_d = triton.next_power_of_2(half)
    return (_rope_kernel, (T,), (q, k, cos, sin, hq, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 cos.stride(0), sin.stride(0)),
            dict(HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
                 num_warps=max(1, min(8, block_hq * block_d // 256)), enable_fp_fusion=False))


def _check(q, k, cos, sin) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D], one T and even D")
    if q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need one dtype and a unit-stride head dim")
    want = (q.shape[0], q.shape[2])
    if cos.shape != want or sin.shape != want or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be {want}, unit-stride rows")
