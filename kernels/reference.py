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


def _decode(q, kc, vc, batch: DecodeBatch, scale, window, cache) -> torch.Tensor:
    # q: [B, H, D]; gathered K/V: [B, L, Hkv, D]
    if batch.block_table is not None:
        keys, values = _gather_blocks(cache["k"], batch.block_table), _gather_blocks(cache["v"], batch.block_table)
    else:
        keys, values = kc[batch.slots], vc[batch.slots]
    mask = batch.mask
    if window is not None:
        k_pos = torch.arange(mask.shape[-1], device=q.device).view(1, 1, 1, -1)
        mask = mask & (k_pos > (batch.ctx_lens - 1 - window).view(-1, 1, 1, 1))
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True)                        # [B, H, 1, D]
    return o.squeeze(2)
