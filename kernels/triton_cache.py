"""Triton write of a step's new K/V rows into the paged cache (the CUDA twin of ``reference.write_to_cache``).

Called by ``triton_attention.paged_attention`` once per layer per step, before the attention
kernel reads the cache. One launch writes every token of the step, K and V both:

    k, v       [T, Hkv, D]                          (any strides)
    cache      {"k": [num_blocks, block_size, Hkv, D], "v": same}
    row t  ->  flat slot slot_mapping[t] = block_id * block_size + offset;  slot < 0: padding, skipped

Grid: one program per (BLOCK_T tokens, BLOCK_HD of the flattened Hkv*D row). Each program loads
its tokens' slots, then copies a [BLOCK_T, BLOCK_HD] tile of K and of V, cast to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 4096   # elements per tile: 16 KB of fp32 registers over 4 warps


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["slot_ptr"])   # vary per step
def _write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, T,
                  k_t, k_h, k_d, v_t, v_h, v_d,        # k, v strides
                  c_blk, c_off, c_h, c_d,              # cache strides (shared)
                  D: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)          # [BLOCK_T] token rows
    hd = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)       # [BLOCK_HD] flat (head, dim)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    ok = ((t < T) & (slot >= 0))[:, None] & (hd < HD)[None, :]
    h, d = hd // D, hd % D
    t64 = t.to(tl.int64)[:, None]
    dst = ((slot // BS) * c_blk + (slot % BS) * c_off)[:, None] + (h * c_h + d * c_d)[None, :]
    k = tl.load(k_ptr + t64 * k_t + (h * k_h + d * k_d)[None, :], mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t64 * v_t + (h * v_h + d * v_d)[None, :], mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_to_cache(k: torch.Tensor, v: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> cache["k"/"v"]: [num_blocks, block_size, Hkv, D] at flat slots (< 0 skipped)."""
    kc, vc = cache["k"], cache["v"]
    _check(k, v, kc, vc, slot_mapping)
    if k.shape[0]:
        kernel, grid, args, kwargs = launch(k, v, kc, vc, slot_mapping)
        kernel[grid](*args, **kwargs)


def launch(k, v, kc, vc, slot_mapping):
    """(kernel, grid, args, kwargs) of one write: ``write_to_cache`` launches it, ``offline_compile.py`` compiles it."""
    T, hkv, d = k.shape
    hd = hkv * d
    block_hd = min(triton.next_power_of_2(hd), 1024)
    block_t = max(1, min(16, MAX_TILE // block_hd))
    grid = (triton.cdiv(T, block_t), triton.cdiv(hd, block_hd))
    return (_write_kernel, grid, (k, v, kc, vc, slot_mapping, T, *k.stride(), *v.stride(), *kc.stride()),
            dict(D=d, HD=hd, BS=kc.shape[1], BLOCK_T=block_t, BLOCK_HD=block_hd, num_warps=4))


def _check(k, v, kc, vc, slot_mapping) -> None:
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if kc.shape != vc.shape or kc.stride() != vc.stride():
        raise ValueError(f"cache k {tuple(kc.shape)} and v {tuple(vc.shape)} must have one layout")
    if kc.shape[2:] != k.shape[1:]:
        raise ValueError(f"rows are [Hkv, D] = {tuple(k.shape[1:])}, the cache holds {tuple(kc.shape[2:])}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({k.shape[0]},)")
