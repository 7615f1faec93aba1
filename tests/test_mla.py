"""MLA's two attention paths agree, and the latent-cache decode kernels equal their reference.

* absorbed == plain: for every row of a prompt over a cached prefix, the weight-absorbed path (q through W_UK,
  attention over the latent cache, out through W_UV; row by row as decode rows, and as one short chunk) equals
  the plain path (latent decompressed to per-head K/V) to float32 rounding, on a loaded tiny DeepSeek layer, with
  and without q_lora_rank.
* ``cpu_mla.mla_decode`` (the CPU path) equals ``mla_reference.mla_decode`` on ragged batches (lengths across
  block edges, shuffled block tables, groups larger than one ``GROUP``), and a float64 oracle written here.
* ``write_latent`` writes each row at its slot and skips padding slots (-1).
The Triton kernel is checked in ``test_triton_mla.py`` (the interpreter must be set before triton loads).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.mla import _Prefill
from pdserve.kernels import AttentionMetadata, cpu_mla, mla_reference

torch.set_num_threads(1)
BS = 4


def oracle(q, cache, lens, table, scale, L):
    """float64, per sequence, through the block table: the definition of absorbed MLA decode."""
    lat = cache["latent"].double()
    outs = []
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        ctx = lat[torch.tensor(table[b])[pos // BS], pos % BS, 0]                                 # [S, W]
        p = torch.softmax(q[b].double() @ ctx.t() * scale, dim=-1)
        outs.append(p @ ctx[:, :L])
    return torch.stack(outs)


def ragged(lens, H=4, L=32, R=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + BS - 1) // BS for n in lens]
    perm = (torch.randperm(sum(blocks) + 3, generator=g) + 1).tolist()              # block 0 never used
    tables, i = [], 0
    for nb in blocks:
        tables.append(perm[i:i + nb])
        i += nb
    cache = {"latent": torch.randn(sum(blocks) + 5, BS, 1, L + R, generator=g).to(dtype)}
    q = torch.randn(len(lens), H, L + R, generator=g).to(dtype)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, BS)
    return q, cache, meta, tables


@pytest.mark.parametrize("lens", [[1], [3, 4, 5], [17, 1, 33, 8, 2, 9, 64, 12, 5, 40, 4]])
def test_cpu_path_equals_reference_and_oracle(lens):
    q, cache, meta, tables = ragged(lens)
    want = oracle(q, cache, lens, tables, 0.3, 32)
    ref = mla_reference.mla_decode(q, cache, meta, 0.3, 32)
    got = cpu_mla.mla_decode(q, cache, meta, 0.3, 32)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cpu_mla.mla_decode(q, cache, meta, 0.3, 32), got)      # the step's plan and workspace reused


def test_write_latent_skips_padding():
    cache = {"latent": torch.zeros(3, BS, 1, 6)}
    rows = torch.arange(18, dtype=torch.float32).view(3, 6)
    mla_reference.write_latent(rows, cache, torch.tensor([5, -1, 0]))
    flat = cache["latent"].view(-1, 6)
    assert torch.equal(flat[5], rows[0]) and torch.equal(flat[0], rows[2])
    assert flat.abs().sum() == rows[0].sum() + rows[2].sum()


@pytest.fixture(scope="module", params=[None, 24], ids=["q-proj", "q-lora"])
def layer(request, tmp_path_factory):
    path = make_tiny_deepseek(tmp_path_factory.mktemp("mla"), "deepseek_v3", seed=1, q_lora_rank=request.param)
    model, config = load_model(path)
    return model, config


def test_absorbed_equals_plain_for_every_row(layer):
    model, config = layer
    attn, T, prefix = model.layers[1].attn, 22, 9           # rows 9..21 extend a 9-token cached prefix
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, config.hidden_size, generator=g)
    caches = config.kv_layout(num_layers=1).allocate(12, BS)
    table = [7, 2, 9, 4, 11, 1]
    meta = AttentionMetadata.build([T], [T], [table], BS)
    cos, sin = model.rotary(torch.arange(T))
    q_nope, q_pe, latent = attn.project(x, cos, sin)
    mla_reference.write_latent(latent, caches[0], meta.slot_mapping)
    plain = attn.plain(q_nope[prefix:], q_pe[prefix:], latent[prefix:], caches[0],
                       _Prefill(slice(prefix, T), T - prefix, T, meta.block_table[0]))       # [Q, H, v]
    rows = torch.arange(prefix, T)
    absorbed = attn.absorbed(q_nope[rows], q_pe[rows], caches[0], meta.for_rows(rows))
    assert plain.abs().max() > 0.1
    torch.testing.assert_close(absorbed, plain, atol=2e-5, rtol=1e-4)
    whole = attn.plain(q_nope, q_pe, latent, caches[0], _Prefill(slice(0, T), T, T, meta.block_table[0]))
    torch.testing.assert_close(whole[prefix:], plain, atol=2e-5, rtol=1e-4)      # no prefix gather == gathered
    chunk = attn.absorbed_chunk(q_nope[prefix:], q_pe[prefix:], latent[prefix:], caches[0],
                                _Prefill(slice(prefix, T), T - prefix, T, meta.block_table[0], True))
    torch.testing.assert_close(chunk, plain, atol=2e-5, rtol=1e-4)              # a short chunk, absorbed


def test_plan_sends_decodes_and_short_extends_absorbed(layer):
    _, config = layer                                     # tiny dims: absorbed below 32 rows over a prefix
    from pdserve.engine.models.mla import _plan, absorb_below

    assert absorb_below(config.mla) == 32
    #        decode   short extend (5 over 20)   long extend (40 over 60)   first chunk (8, no prefix)
    meta = AttentionMetadata.build([1, 5, 40, 8], [9, 25, 100, 8], [[1, 2, 3], [4] * 7, [5] * 25, [6, 7]], BS)
    plan = _plan(meta, config.mla)
    assert plan.decode_rows.tolist() == [0] and plan.decode_meta.seq_lens_cpu.tolist() == [9]
    assert [(p.rows, p.q_len, p.seq_len, p.absorbed) for p in plan.prefills] == [
        (slice(1, 6), 5, 25, True), (slice(6, 46), 40, 100, False), (slice(46, 54), 8, 8, False)]
    assert _plan(AttentionMetadata.build([1, 1], [3, 9], [[1], [2, 3, 4]], BS), config.mla).decode_rows is None
