"""The torch paged attention (the reference for Triton kernels) equals dense causal attention.

Ragged batches over a scrambled block table: a chunked prefill on top of cached context, a first
chunk with no context, decodes of mixed lengths (more than one sorted group), GQA, a sliding
window; and padding rows (slot -1) write nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import AttentionMetadata, paged_attention, write_to_cache

BS, H, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 200


def _dense(q, k, v, scale, window):
    """q [Q, H, D] at the last Q positions of k/v [C, Hkv, D]: plain causal attention."""
    C, Q = k.shape[0], q.shape[0]
    qp, kp = torch.arange(C - Q, C).unsqueeze(1), torch.arange(C).unsqueeze(0)
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    rep = H // HKV
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                       v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _run(specs, window, seed=0):
    """specs: [(seq_len, q_len)] -> (paged output, dense expected) for one ragged step."""
    g = torch.Generator().manual_seed(seed)
    cache = {c: torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g) for c in ("k", "v")}
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[perm.pop() for _ in range((s + BS - 1) // BS)] for s, _ in specs]
    meta = AttentionMetadata.build([n for _, n in specs], [s for s, _ in specs], tables, BS)
    T = sum(n for _, n in specs)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    out = paged_attention(q, k, v, cache, meta, 0.3, window)
    flat = {c: cache[c].view(-1, HKV, D) for c in cache}
    expected, row = [], 0
    for (s, n), t in zip(specs, tables):
        pos = torch.arange(s)
        slots = torch.tensor(t)[pos // BS] * BS + pos % BS
        expected.append(_dense(q[row:row + n], flat["k"][slots], flat["v"][slots], 0.3, window))
        row += n
    return out, torch.cat(expected)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_dense(window):
    # a 6-token chunk over 9 cached tokens, a first chunk of 7, decodes with 14 and 4 tokens of context
    out, expected = _run([(15, 6), (7, 7), (14, 1), (4, 1)], window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_many_decodes_of_mixed_lengths_are_grouped_exactly(window):
    """More decodes than one group (kernels.reference.DECODE_GROUP): sorted groups == dense, row order kept."""
    lens = torch.randint(1, 30, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    out, expected = _run([(s, 1) for s in lens], window, seed=3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_padding_rows_write_nothing():
    cache = {c: torch.zeros(4, BS, HKV, D) for c in ("k", "v")}
    k = torch.ones(3, HKV, D)
    write_to_cache(k, 2 * k, cache, torch.tensor([5, -1, 6]))
    flat = cache["k"].view(-1, HKV, D)
    assert flat.sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 6]
    assert cache["v"].view(-1, HKV, D)[5].eq(2).all()
