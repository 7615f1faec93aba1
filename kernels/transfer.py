"""Block gather/scatter for KV transfer: paged cache <-> one contiguous tensor per (chunk, layer).

Called by the prefill publisher (gather, then ``put`` to the store) and the decode loader
(``get`` from the store, then scatter). Plain torch; the CUDA path plugs in behind the same names.
``gather_chunk``/``scatter_chunk`` move every layer of a chunk at once (Triton twins in triton_transfer.py).

    layer cache  {"k": [num_blocks, block_size, Hkv, D], "v": ...}
    slots        [N] flat slot of each token of the chunk (through the block table)
    object       [C, N, Hkv, D]   C = number of components (2 for K/V, 1 for an MLA latent)
"""

from __future__ import annotations

import torch


def gather_kv(layer_cache: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """-> [C, N, Hkv, D] on the CPU, a fresh contiguous tensor (safe to hand to another thread)."""
    parts = [_flat(t).index_select(0, slots.to(t.device)) for t in layer_cache.values()]
    return torch.stack(parts).cpu()


def scatter_kv(layer_cache: dict[str, torch.Tensor], slots: torch.Tensor, obj: torch.Tensor,
               heads: slice | None = None) -> None:
    """Write obj [C, N, Hkv_total, D] at slots; ``heads`` picks this rank's KV heads (TP readers)."""
    if obj.shape[0] != len(layer_cache):
        raise ValueError(f"object has {obj.shape[0]} components, the cache layer has {len(layer_cache)}")
    for i, t in enumerate(layer_cache.values()):
        src = obj[i] if heads is None else obj[i][:, heads]
        _flat(t).index_copy_(0, slots.to(t.device), src.to(device=t.device, dtype=t.dtype))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *t.shape[2:])   # [num_blocks * block_size, Hkv, D]


# All layers of a chunk at once: the whole KV cache as one tensor (the Triton kernels in
# triton_transfer.py have these signatures; these are their references and the CPU path).
#   kv   [L, C, num_blocks, block_size, Hkv, D]     slots [n] int64     object [L, C, n, Hkv, D]


def gather_chunk(kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """-> [L, C, n, Hkv, D] on kv's device (into ``out`` when given)."""
    flat, slots = _flat_chunk(kv), slots.to(kv.device)
    if out is None:
        return flat.index_select(2, slots)
    if out.shape != (*kv.shape[:2], slots.shape[0], *kv.shape[4:]) or not out.is_contiguous():
        raise ValueError(f"out is {tuple(out.shape)}; need a contiguous {(*kv.shape[:2], slots.shape[0], *kv.shape[4:])}")
    return torch.index_select(flat, 2, slots, out=out)        # straight into out (a staging slot): no temporary


def scatter_chunk(kv: torch.Tensor, slots: torch.Tensor, obj: torch.Tensor, head_start: int = 0) -> None:
    """Write heads head_start : head_start + Hkv of obj [L, C, n, Hkv_total, D] at slots of every layer."""
    hkv = kv.shape[4]
    if obj.shape[:2] != kv.shape[:2] or head_start + hkv > obj.shape[3]:
        raise ValueError(f"object {tuple(obj.shape)} does not hold heads {head_start}..{head_start + hkv - 1} "
                         f"of a cache {tuple(kv.shape)}")
    src = obj[:, :, :, head_start:head_start + hkv].to(device=kv.device, dtype=kv.dtype)
    _flat_chunk(kv).index_copy_(2, slots.to(kv.device), src)


def _flat_chunk(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(*kv.shape[:2], -1, *kv.shape[4:])   # [L, C, num_blocks * block_size, Hkv, D]
