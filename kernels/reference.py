"""Plain-torch paged attention: the CPU path and the reference every Triton kernel is tested against.

Called once per attention layer per step by the model (through ``pdserve.kernels.paged_attention``):

    1. write the step's new K/V rows into the paged cache at ``meta.slot_mapping``
    2. for each prefill sequence: gather its context from the cache, causal attention
    3. for the decode batch: gather a padded ``[B, L]`` context, one query per sequence
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.metadata import AttentionMetadata, DecodeBatch, PrefillSeq


def write_to_cache(k: torch.Tensor, v: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> cache["k"/"v"]: [num_blocks, block_size, Hkv, D] at flat slots."""
    for name, x in (("k", k), ("v", v)):
        flat = cache[name].view(-1, *cache[name].shape[2:])
        flat.index_copy_(0, slot_mapping, x.to(flat.dtype))


def paged_attention(q, k, v, cache: dict, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H, D]."""
    write_to_cache(k, v, cache, meta.slot_mapping)
    kc = cache["k"].view(-1, *cache["k"].shape[2:])   # [slots, Hkv, D]
    vc = cache["v"].view(-1, *cache["v"].shape[2:])
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        if seq.ctx_len == seq.q_len and sliding_window is None:   # no cached context: plain causal
            out[rows] = _causal(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = _prefill(q[rows], kc, vc, seq, scale, sliding_window, cache)
    if meta.decodes is not None:
        out[meta.decodes.rows] = _decode(q[meta.decodes.rows], kc, vc, meta.decodes, scale, sliding_window, cache)
    return out


def _causal(q, k, v, scale) -> torch.Tensor:
    # q: [Q, H, D]; k, v: [Q, Hkv, D], the whole sequence: no gather, no explicit mask
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], table [...] -> [..., bs * len, Hkv, D] (whole blocks, in table order)."""
    blocks = cache.index_select(0, table.reshape(-1))
    return blocks.view(*table.shape[:-1], table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _prefill(q, kc, vc, seq: PrefillSeq, scale, window, cache) -> torch.Tensor:
    # q: [Q, H, D]; context K/V: [C, Hkv, D] with C >= Q; query i sits at position C - Q + i
    if seq.block_table is not None:
        keys = _gather_blocks(cache["k"], seq.block_table)[: seq.ctx_len]
        values = _gather_blocks(cache["v"], seq.block_table)[: seq.ctx_len]
    else:
        keys, values = kc[seq.ctx_slots], vc[seq.ctx_slots]
    q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=q.device).unsqueeze(1)   # [Q, 1]
    k_pos = torch.arange(seq.ctx_len, device=q.device).unsqueeze(0)                            # [1, C]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)                                                  # [Q, H, D]


DECODE_GROUP = 8   # decodes attended together; sorted by context length so each group pads little


def _decode(q, kc, vc, batch: DecodeBatch, scale, window, cache) -> torch.Tensor:
    # q: [B, H, D] -> [B, H, D]
    if batch.block_table is None:
        keys, values = kc[batch.slots], vc[batch.slots]                      # [B, L, Hkv, D]
        return _attend_one(q, keys, values, batch.mask, batch.ctx_lens, scale, window)
    if q.shape[0] <= DECODE_GROUP:
        return _decode_blocks(q, cache, batch.block_table, batch.ctx_lens, scale, window)
    # Mixed lengths in one padded [B, max_len] batch waste most of the gather and the attention
    # (3x on 64 decodes of 128..640 tokens); sorted groups of 8 pad only to their own maximum.
    out = torch.empty_like(q)
    order = torch.argsort(batch.ctx_lens)
    for i in range(0, q.shape[0], DECODE_GROUP):
        rows = order[i:i + DECODE_GROUP]
        out[rows] = _decode_blocks(q[rows], cache, batch.block_table[rows], batch.ctx_lens[rows], scale, window)
    return out


def _decode_blocks(q, cache, table, lens, scale, window) -> torch.Tensor:
    """q: [b, H, D]; table: [b, nb] padded; lens: [b] -> [b, H, D]; gathers only the blocks the longest needs."""
    bs = cache["k"].shape[1]
    nb = int((lens.max() + bs - 1) // bs)
    table = table[:, :nb]
    keys, values = _gather_blocks(cache["k"], table), _gather_blocks(cache["v"], table)   # [b, nb*bs, Hkv, D]
    mask = (torch.arange(nb * bs, device=q.device).unsqueeze(0) < lens.unsqueeze(1)).view(-1, 1, 1, nb * bs)
    return _attend_one(q, keys, values, mask, lens, scale, window)


def _attend_one(q, keys, values, mask, lens, scale, window) -> torch.Tensor:
    """One query per sequence: q [b, H, D], keys/values [b, L, Hkv, D], mask [b, 1, 1, L]."""
    if window is not None:
        k_pos = torch.arange(mask.shape[-1], device=q.device).view(1, 1, 1, -1)
        mask = mask & (k_pos > (lens - 1 - window).view(-1, 1, 1, 1))
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True)                        # [b, H, 1, D]
    return o.squeeze(2)
