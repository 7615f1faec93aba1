"""The torch paged attention (the reference for Triton kernels) equals dense causal attention.

Ragged batches over a scrambled block table: a chunked prefill on top of cached context, a first
chunk with no context, decodes of mixed lengths (more than one sorted group), GQA, a sliding
window; and padding rows (slot -1) write nothing. Every layer of a step gathers into one workspace
(float64 oracle, the buffer's storage checked across layers).
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


def _dense64(q, k, v, scale, window=None):
    """_dense by hand in float64: softmax(q k^T * scale + causal mask) v, K/V heads repeated."""
    q, k, v = (x.double() for x in (q, k, v))
    C, Q = k.shape[0], q.shape[0]
    qp, kp = torch.arange(C - Q, C).unsqueeze(1), torch.arange(C).unsqueeze(0)
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    k, v = (x.repeat_interleave(H // HKV, 1).transpose(0, 1) for x in (k, v))      # [H, C, D]
    scores = (q.transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)                                 # [Q, H, D]


def _step(specs, seed):
    """specs: [(seq_len, q_len)] -> (cache, tables, meta, q, k, v) for one ragged step."""
    g = torch.Generator().manual_seed(seed)
    cache = {c: torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g) for c in ("k", "v")}
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[perm.pop() for _ in range((s + BS - 1) // BS)] for s, _ in specs]
    meta = AttentionMetadata.build([n for _, n in specs], [s for s, _ in specs], tables, BS)
    T = sum(n for _, n in specs)
    return (cache, tables, meta, *(torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV)))


def _expected(dense, specs, tables, cache, q, window):
    """Each sequence's rows attended densely over its K/V read back from the cache by slot."""
    flat = {c: cache[c].view(-1, HKV, D) for c in cache}
    expected, row = [], 0
    for (s, n), t in zip(specs, tables):
        pos = torch.arange(s)
        slots = torch.tensor(t)[pos // BS] * BS + pos % BS
        expected.append(dense(q[row:row + n], flat["k"][slots], flat["v"][slots], 0.3, window))
        row += n
    return torch.cat(expected)


def _run(specs, window, seed=0):
    """specs: [(seq_len, q_len)] -> (paged output, dense expected) for one ragged step."""
    cache, tables, meta, q, k, v = _step(specs, seed)
    out = paged_attention(q, k, v, cache, meta, 0.3, window)
    return out, _expected(_dense, specs, tables, cache, q, window)


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


@pytest.mark.parametrize("window", [None, 6])
def test_every_layer_of_a_step_gathers_into_one_workspace(window):
    """Two layers (own caches, own K/V) share one plan: a chunk over 30 cached tokens, a first chunk,
    12 decodes (two groups, the wider one last); each layer equals the float64 oracle, and its gathers
    wrote into the same storage as the first layer's (no buffer allocated per gather or per layer)."""
    lens = torch.randint(2, 40, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    specs = [(36, 6), (5, 5)] + [(s, 1) for s in lens]
    _, tables, meta, *_ = _step(specs, seed=5)
    ordered = sorted(lens)
    widest = max([(s + BS - 1) // BS for s, _ in specs[:2]]              # a prefill's blocks, or a group's
                 + [len(g) * ((g[-1] + BS - 1) // BS) for g in (ordered[:8], ordered[8:])])
    storages = []
    for layer in range(2):
        cache, _, _, q, k, v = _step(specs, seed=10 + layer)
        out = paged_attention(q, k, v, cache, meta, 0.3, window)
        torch.testing.assert_close(out.double(), _expected(_dense64, specs, tables, cache, q, window),
                                   rtol=1e-5, atol=1e-5)
        ws = meta.derived["torch"].workspace(cache)
        storages.append({c: ws[c].untyped_storage().data_ptr() for c in ws})
        assert ws["k"].shape[0] == widest
    assert storages[0] == storages[1]


def test_padding_rows_write_nothing():
    cache = {c: torch.zeros(4, BS, HKV, D) for c in ("k", "v")}
    k = torch.ones(3, HKV, D)
    write_to_cache(k, 2 * k, cache, torch.tensor([5, -1, 6]))
    flat = cache["k"].view(-1, HKV, D)
    assert flat.sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 6]
    assert cache["v"].view(-1, HKV, D)[5].eq(2).all()



@pytest.mark.parametrize("cuts", [(), (128,), (130,), (16, 256)])
def test_prefill_rows_are_the_unfused_math_bit_for_bit(cuts):
    """Prefill and extend rows are SDPA's unfused math path, bit for bit (the reference an engine's KV bytes
    were always made by): SDPA's fused CPU kernel tiles queries by the chunk's length, so the same prompt
    chunked differently by two engines gave different KV bytes for one prefix, and the decode node's digest
    check failed on chunks another prefill node had published (tests/test_kv_stress.py)."""
    L, heads, g = 300, (H, HKV, HKV), torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(L, h, 64, generator=g) for h in heads)
    table = list(range((L + BS - 1) // BS))
    cache = {c: torch.zeros(NUM_BLOCKS, BS, HKV, 64) for c in ("k", "v")}
    for start, end in zip((0, *cuts), (*cuts, L)):
        meta = AttentionMetadata.build([end - start], [end], [table], BS)
        out = paged_attention(q[start:end], k[start:end], v[start:end], cache, meta, 0.125)
        qp, kp = torch.arange(start, end).unsqueeze(1), torch.arange(end).unsqueeze(0)
        unfused = F.scaled_dot_product_attention(         # 3-D inputs: SDPA's math path
            q[start:end].transpose(0, 1), k[:end].transpose(0, 1), v[:end].transpose(0, 1),
            attn_mask=None if start == 0 else kp <= qp, is_causal=start == 0, scale=0.125, enable_gqa=True)
        assert torch.equal(out, unfused.transpose(0, 1)), (start, end)
