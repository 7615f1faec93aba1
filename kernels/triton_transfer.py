"""Triton block gather/scatter for KV transfer: every layer of a chunk in one launch each way.

Called by the KV connector on CUDA in place of ``transfer.gather_chunk`` / ``transfer.scatter_chunk``
(same signatures; those are the references): the prefill side gathers a chunk's slots from the whole
cache into one contiguous object and publishes it; the decode side scatters a loaded object back.

    kv      [L, C, num_blocks, block_size, Hkv, D]   the whole KV cache (C = 2 for K/V)
    slots   [n] int64 flat slots (block_id * block_size + offset); slot < 0: row skipped
    object  [L, C, n, Hkv_total, D]                  scatter writes heads head_start : head_start + Hkv

Grid: (row blocks of BLOCK_T slots, BLOCK_HD pieces of the flat Hkv*D row, L * C). One kernel does
both directions (``TO_CACHE``); each program loads its slots once and copies a [BLOCK_T, BLOCK_HD] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 8192   # elements moved per program: 16 KB of bf16


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["slot_ptr"])   # vary per chunk
def _copy_kernel(kv_ptr, obj_ptr, slot_ptr, n, C,
                 k_l, k_c, k_blk, k_off, k_h, k_d,        # kv strides
                 o_l, o_c, o_t, o_h, o_d,                 # object strides (a head slice when scattering)
                 D: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, TO_CACHE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr):
    lc = tl.program_id(2)
    layer, comp = (lc // C).to(tl.int64), (lc % C).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)          # [BLOCK_T] rows of the chunk
    hd = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)       # [BLOCK_HD] flat (head, dim)
    slot = tl.load(slot_ptr + t, mask=t < n, other=-1).to(tl.int64)
    h, d = hd // D, hd % D
    in_range = (t < n)[:, None] & (hd < HD)[None, :]
    ok = in_range & (slot >= 0)[:, None]
    cache_off = (layer * k_l + comp * k_c + (slot // BS) * k_blk + (slot % BS) * k_off)[:, None] \
        + (h * k_h + d * k_d)[None, :]
    obj_off = (layer * o_l + comp * o_c + t.to(tl.int64) * o_t)[:, None] + (h * o_h + d * o_d)[None, :]
    if TO_CACHE:
        x = tl.load(obj_ptr + obj_off, mask=ok)
        tl.store(kv_ptr + cache_off, x.to(kv_ptr.dtype.element_ty), mask=ok)
    else:
        x = tl.load(kv_ptr + cache_off, mask=ok, other=0)
        tl.store(obj_ptr + obj_off, x.to(obj_ptr.dtype.element_ty), mask=in_range)   # skipped slots: zeros


def gather_chunk(kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """-> [L, C, n, Hkv, D] on kv's device (into ``out`` when given)."""
    L, C, _, _, hkv, d = kv.shape
    if out is None:
        out = torch.empty(L, C, slots.shape[0], hkv, d, dtype=kv.dtype, device=kv.device)
    elif out.shape != (L, C, slots.shape[0], hkv, d) or out.device != kv.device:
        raise ValueError(f"out is {tuple(out.shape)} on {out.device}; "
                         f"need {(L, C, slots.shape[0], hkv, d)} on {kv.device}")
    _launch(kv, out, slots.to(kv.device), to_cache=False)
    return out


def scatter_chunk(kv: torch.Tensor, slots: torch.Tensor, obj: torch.Tensor, head_start: int = 0) -> None:
    """Write heads head_start : head_start + Hkv of obj [L, C, n, Hkv_total, D] at slots of every layer."""
    hkv = kv.shape[4]
    if obj.shape[:2] != kv.shape[:2] or obj.shape[4] != kv.shape[5] or head_start + hkv > obj.shape[3]:
        raise ValueError(f"object {tuple(obj.shape)} does not hold heads {head_start}..{head_start + hkv - 1} "
                         f"of a cache {tuple(kv.shape)}")
    heads = obj.to(kv.device)[:, :, :, head_start:head_start + hkv]   # a strided view: no copy on device
    _launch(kv, heads, slots.to(kv.device), to_cache=True)


def _launch(kv: torch.Tensor, obj: torch.Tensor, slots: torch.Tensor, to_cache: bool) -> None:
    if slots.shape[0]:
        kernel, grid, args, kwargs = launch(kv, obj, slots, to_cache)
        kernel[grid](*args, **kwargs)


def launch(kv: torch.Tensor, obj: torch.Tensor, slots: torch.Tensor, to_cache: bool):
    """(kernel, grid, args, kwargs) of one gather or scatter: ``_launch`` runs it, ``offline_compile.py`` builds
    it for sm_90."""
    L, C, _, bs, hkv, d = kv.shape
    n, hd = slots.shape[0], hkv * d
    block_hd = min(triton.next_power_of_2(hd), 1024)
    block_t = max(1, min(64, MAX_TILE // block_hd))
    grid = (triton.cdiv(n, block_t), triton.cdiv(hd, block_hd), L * C)
    return (_copy_kernel, grid, (kv, obj, slots, n, C, *kv.stride(), *obj.stride()),
            dict(D=d, HD=hd, BS=bs, TO_CACHE=to_cache, BLOCK_T=block_t, BLOCK_HD=block_hd, num_warps=4))
