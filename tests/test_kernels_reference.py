"""The torch paged attention (the reference for Triton kernels) equals dense causal attention.

Both context paths are checked — token-by-token slots and whole-block tables — with GQA, a
scrambled block table, chunked prefill on top of cached context, a decode batch of mixed lengths,
and a sliding window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import AttentionMetadata, DecodeBatch, PrefillSeq, paged_attention

BS, H, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 40


def _dense(q, k, v, scale, window):
    """q [Q, H, D] at the last Q positions of k/v [C, Hkv, D]: plain causal attention."""
    C, Q = k.shape[0], q.shape[0]
    qp, kp = torch.arange(C - Q, C).unsqueeze(1), torch.arange(C).unsqueeze(0)
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    rep = H // HKV
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                       v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _case(seed: int, use_blocks: bool, window):
    g = torch.Generator().manual_seed(seed)
    cache = {c: torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g) for c in ("k", "v")}
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    # seq A: 9 cached tokens + 6 new (chunked prefill); seqs B, C: decodes with 13 and 3 tokens of context
    specs, tables = [(15, 6), (14, 1), (4, 1)], []
    for total, _ in specs:
        nb = (total + BS - 1) // BS
        tables.append(torch.tensor([perm.pop() for _ in range(nb)]))
    T = sum(n for _, n in specs)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    slots = [t[torch.arange(total) // BS] * BS + torch.arange(total) % BS for t, (total, _) in zip(tables, specs)]
    slot_mapping = torch.cat([s[total - n:] for s, (total, n) in zip(slots, specs)])
    prefill = PrefillSeq(0, 6, slots[0], block_table=tables[0] if use_blocks else None)
    lens = torch.tensor([14, 4])
    if use_blocks:
        table = torch.zeros(2, 4, dtype=torch.long)
        table[0, :4], table[1, :1] = tables[1], tables[2]
        mask = (torch.arange(16) < lens.unsqueeze(1)).view(2, 1, 1, 16)
        decodes = DecodeBatch(torch.tensor([6, 7]), None, mask, lens, block_table=table)
    else:
        padded = torch.zeros(2, 14, dtype=torch.long)
        padded[0], padded[1, :4] = slots[1], slots[2]
        mask = (torch.arange(14) < lens.unsqueeze(1)).view(2, 1, 1, 14)
        decodes = DecodeBatch(torch.tensor([6, 7]), padded, mask, lens)
    meta = AttentionMetadata(slot_mapping, [prefill], decodes, BS)
    out = paged_attention(q, k, v, cache, meta, 0.3, window)
    flat = {c: cache[c].view(-1, HKV, D) for c in cache}
    expected = [_dense(q[:6], flat["k"][slots[0]], flat["v"][slots[0]], 0.3, window),
                _dense(q[6:7], flat["k"][slots[1]], flat["v"][slots[1]], 0.3, window),
                _dense(q[7:8], flat["k"][slots[2]], flat["v"][slots[2]], 0.3, window)]
    return out, torch.cat(expected)


@pytest.mark.parametrize("use_blocks", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_dense(use_blocks, window):
    out, expected = _case(0, use_blocks, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_and_token_paths_agree():
    a, _ = _case(1, True, None)
    b, _ = _case(1, False, None)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [None, 7])
def test_many_decodes_of_mixed_lengths_are_grouped_exactly(window):
    """More decodes than one group (kernels.reference.DECODE_GROUP): sorted groups == one padded batch."""
    g = torch.Generator().manual_seed(3)
    cache = {c: torch.randn(NUM_BLOCKS * 4, BS, HKV, D, generator=g) for c in ("k", "v")}
    lens = torch.randint(1, 30, (20,), generator=g)
    nb = int((lens.max() + BS - 1) // BS)
    table = torch.stack([torch.randperm(NUM_BLOCKS * 4, generator=g)[:nb] for _ in range(20)])   # [20, nb]
    q, k, v = (torch.randn(20, h, D, generator=g) for h in (H, HKV, HKV))
    pos = lens - 1
    slot_mapping = table[torch.arange(20), pos // BS] * BS + pos % BS
    slots = table[:, torch.arange(nb * BS) // BS] * BS + torch.arange(nb * BS) % BS                 # [20, nb*BS]
    mask = (torch.arange(nb * BS) < lens.unsqueeze(1)).view(20, 1, 1, -1)
    rows = torch.arange(20)
    grouped = paged_attention(q, k, v, {c: t.clone() for c, t in cache.items()},
                              AttentionMetadata(slot_mapping, [], DecodeBatch(rows, None, mask, lens, table), BS),
                              0.3, window)
    padded = paged_attention(q, k, v, {c: t.clone() for c, t in cache.items()},
                             AttentionMetadata(slot_mapping, [], DecodeBatch(rows, slots, mask, lens), BS), 0.3, window)
    torch.testing.assert_close(grouped, padded, rtol=1e-6, atol=1e-6)
