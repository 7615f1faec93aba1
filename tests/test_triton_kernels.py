"""The Triton kernels equal their torch references: compiled on a GPU, or on CPU in Triton's interpreter.

Every kernel test takes the ``device`` fixture: ``cuda`` when CUDA is available and TRITON_INTERPRET is not 1
(``bench/gpu_check.sh`` sets TRITON_INTERPRET=0 on the device: compiled launches on device tensors), else
``cpu`` under the interpreter (this file sets TRITON_INTERPRET=1 unless the environment says otherwise).
The interpreter's bf16 ``tl.dot`` is wrong, so there the kernel runs fp32 dots even for bf16 tensors; the
bf16 tensor-core path is checked only on a GPU (``test_bf16_dots_match_reference``, skipped here with why).

Attention is checked on ragged batches mixing decode rows and prefill/extend chunks over a cached
prefix, against ``reference.paged_attention`` and against a float64 oracle written here (per
sequence: gather the context through the block table, causal + window mask, softmax). Padding
block-table entries and never-written cache rows hold NaN in the Triton run, so a read past a
sequence's end shows up in its output. Cache writes and chunk transfers are bit-exact. The compiled
mode the interpreter does not exercise is built for sm_90 without a GPU by ``tests/test_kernel_compile.py``.
"""

from __future__ import annotations

import os
from functools import partial

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed")

from pdserve.kernels import AttentionMetadata, reference, transfer  # noqa: E402
from pdserve.kernels.triton_attention import (MAX_SPLITS, MIN_SPLIT_KEYS, paged_attention,  # noqa: E402
                                              plan_attention, unified_attention)
from pdserve.kernels.triton_cache import write_to_cache  # noqa: E402
from pdserve.kernels.staging import Staging  # noqa: E402
from pdserve.kernels.triton_transfer import gather_chunk, scatter_chunk  # noqa: E402

NAN_BLOCK = 0   # block 0 is never allocated: padding entries of the block table point at it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
BF16_TOL = 2e-2     # bf16 operands on tensor cores: P rounded to bf16 before P @ V, the output to bf16


@pytest.fixture
def device() -> str:
    """Where the kernels run: ``cuda`` compiled, or ``cpu`` in the interpreter (see the module docstring)."""
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: a compiled launch needs a GPU")
    return DEVICE


def _batch(specs, bs, hkv, d, dtype=torch.float32, qpk=1, seed=0, pad_rows=0, device="cpu"):
    """specs: [(seq_len, q_len)] -> (q, k, v, cache, meta) on ``device``. Cached prefixes are random, the rest NaN.

    ``pad_rows`` CUDA-graph padding sequences (q_len 1, seq_len 1, slot -1) follow the real ones. Built on the
    CPU (one generator: the same numbers on every device), then moved; the metadata's host mirrors stay.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in specs] + [1] * pad_rows
    q_lens = [n for _, n in specs] + [1] * pad_rows
    table = _block_table([-(-s // bs) for s, _ in specs] + [0] * pad_rows, g)
    cache = {c: torch.full((int(table.max()) + 1, bs, hkv, d), float("nan"), dtype=dtype) for c in "kv"}
    slots = []
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(seq_len)
        flat = table[b, pos // bs].long() * bs + pos % bs        # [seq_len] slots of positions 0..
        for c in "kv":                                            # the prefix written by earlier steps
            rows = torch.randn(seq_len - q_len, hkv, d, generator=g)
            cache[c].view(-1, hkv, d)[flat[:seq_len - q_len]] = rows.to(dtype)
        slots.append(flat[seq_len - q_len:] if b < len(specs) else torch.tensor([-1]))
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.cat(slots).to(device), qsl.to(device), lens.to(device), table.to(device),
                             max(q_lens), max(seq_lens), bs, qsl.clone(), lens.clone(), backend="triton")
    q, k, v = (torch.randn(int(qsl[-1]), h, d, generator=g).to(dtype).to(device) for h in (hkv * qpk, hkv, hkv))
    return q, k, v, {c: t.to(device) for c, t in cache.items()}, meta


def _block_table(num_blocks, g) -> torch.Tensor:
    """[B, max + 1] int32 of scrambled distinct ids >= 1; the padding entries point at NAN_BLOCK."""
    perm = (1 + torch.randperm(sum(num_blocks), generator=g)).tolist()
    table = torch.full((len(num_blocks), max(num_blocks) + 1), NAN_BLOCK, dtype=torch.int32)
    for b, nb in enumerate(num_blocks):
        table[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    return table


def _oracle(q, cache, meta, scale, window):
    """float64 attention per sequence over the (already written) cache -> [T, H, D] on the CPU; padding rows NaN."""
    q, cache = q.cpu(), {c: t.cpu() for c, t in cache.items()}
    slots, table = meta.slot_mapping.cpu(), meta.block_table.cpu()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    bs, hkv = cache["k"].shape[1], cache["k"].shape[2]
    for b in range(meta.num_seqs):
        lo, hi = int(meta.query_start_loc_cpu[b]), int(meta.query_start_loc_cpu[b + 1])
        seq_len = int(meta.seq_lens_cpu[b])
        if slots[lo] < 0:
            continue
        pos = torch.arange(seq_len)
        flat = table[b, pos // bs].long() * bs + pos % bs
        keys, values = (cache[c].view(-1, hkv, q.shape[2])[flat].double() for c in "kv")   # [S, Hkv, D]
        rep = q.shape[1] // hkv
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        qp = torch.arange(seq_len - (hi - lo), seq_len).unsqueeze(1)
        seen = (pos.unsqueeze(0) <= qp) & ((pos.unsqueeze(0) > qp - window) if window else True)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), keys) * scale
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", p, values)
    return out


DECODES = [(1, 1), (7, 1), (16, 1), (13, 1)]              # one-token context, mid-block and full-block ends
MIXED = [(9, 9), (21, 5), (1, 1), (6, 1), (12, 3)]        # fresh prefill, extends over cached prefixes, decodes
GQA = [(2, 1), (1, 4), (1, 8)]                            # (Hkv, H / Hkv)


def _check(q, k, v, cache, meta, scale, window, tol=1e-5, num_splits=None):
    """Triton on the NaN-poisoned cache == reference.paged_attention on a clean copy == the oracle (on q's device)."""
    ref_cache = {c: t.nan_to_num(0.0) for c, t in cache.items()}   # the reference gathers whole blocks
    out = paged_attention(q, k, v, cache, meta, scale, window, num_splits=num_splits)
    expected = reference.paged_attention(q, k, v, ref_cache, meta, scale, window)
    real = meta.slot_mapping >= 0                                  # padding rows' output is unspecified
    assert out.dtype == q.dtype
    torch.testing.assert_close(out[real], expected[real], atol=tol, rtol=tol)
    torch.testing.assert_close(out[real].double().cpu(), _oracle(q, cache, meta, scale, window)[real.cpu()],
                               atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("hkv,qpk", GQA)
@pytest.mark.parametrize("d,bs", [(64, 16), (48, 4)])
@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decode", "mixed"])
def test_attention_matches_references(device, specs, d, bs, hkv, qpk, window):
    q, k, v, cache, meta = _batch(specs, bs, hkv, d, qpk=qpk, pad_rows=1, device=device)
    _check(q, k, v, cache, meta, 0.2, window)


LONG = [(150, 1), (130, 10), (3, 1), (70, 70)]   # several key tiles per program: splits get real work


@pytest.mark.parametrize("d,num_splits,window", [(96, None, None), (96, 3, 5), (256, None, None)])
def test_fp32_wide_heads_read_q_in_chunks(device, d, num_splits, window):
    """fp32 at D_PAD >= 128 runs QK^T in chunks of q re-read per key tile (no spill on sm_90): the same answer."""
    q, k, v, cache, meta = _batch(MIXED, 4, 2, d, qpk=2, seed=4, pad_rows=1, device=device)
    for max_q in (1, meta.max_query_len):                  # the decode tiles and this batch's prefill tiles
        plan = plan_attention(q.shape[0], meta.num_seqs, 4, 2, d, max_q, meta.max_seq_len, True)
        assert plan.q_chunk < triton.next_power_of_2(d) and plan.num_warps == 8
    _check(q, k, v, cache, meta, d ** -0.5, window, num_splits=num_splits)


def test_split_reduce_over_blocks_of_heads(device):
    """The split-K reduce takes 4096 // D_PAD heads per program: 32 heads of 256 merge in two blocks."""
    from pdserve.kernels.attention_plan import reduce_heads

    assert reduce_heads(32, 256) == 16
    q, k, v, cache, meta = _batch(DECODES, 16, 2, 256, qpk=16, seed=5, device=device)
    _check(q, k, v, cache, meta, 256 ** -0.5, None, num_splits=3)


@pytest.mark.parametrize("num_splits,window", [(2, None), (5, 40)])
def test_split_k_equals_one_pass(device, num_splits, window):
    q, k, v, cache, meta = _batch(LONG, 16, 1, 64, qpk=4, seed=1, device=device)
    split = _check(q, k, v, cache, meta, 0.1, window, num_splits=num_splits)
    one = unified_attention(q, cache["k"], cache["v"], torch.empty_like(q), meta, 0.1, window, num_splits=1)
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-5)


def test_splits_past_short_sequences_are_harmless(device):
    q, k, v, cache, meta = _batch(DECODES, 4, 1, 64, qpk=4, seed=2, pad_rows=2, device=device)
    _check(q, k, v, cache, meta, 0.3, None, num_splits=16)


def test_plan_splits_only_long_contexts_of_small_batches():
    plan = partial(plan_attention, num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=1, fp32=False)
    assert plan(1, 1, max_seq_len=32768).num_splits == MAX_SPLITS       # 8 programs: split as far as allowed
    assert plan(4, 4, max_seq_len=1024).num_splits == 1024 // MIN_SPLIT_KEYS
    assert plan(256, 256, max_seq_len=600).num_splits == 1              # 2560 programs already
    assert plan(1, 1, max_seq_len=100).num_splits == 1                  # too short to be worth a reduce
    assert plan(1, 1, max_seq_len=100, num_splits=6).num_splits == 6    # CUDA graphs fix it
    with pytest.raises(ValueError, match="num_splits"):
        plan(1, 1, max_seq_len=100, num_splits=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_half_precision(device, dtype, num_splits):
    q, k, v, cache, meta = _batch(MIXED, 16, 2, 80, dtype=dtype, qpk=3, seed=3, device=device)   # a group of 3: padded
    _check(q, k, v, cache, meta, 80 ** -0.5, 5, tol=3e-2, num_splits=num_splits)


@pytest.mark.parametrize("specs,num_splits,window", [(LONG, None, None), (LONG, 3, None), (MIXED, None, 7)],
                         ids=["long-planned", "long-3-splits", "mixed-window"])
def test_bf16_dots_match_reference(device, specs, num_splits, window):
    """The GPU default: bf16 operands on tensor cores (F32_DOT ""), a Llama-like head group (128 x 4 / 1 KV)."""
    if device == "cpu":
        pytest.skip("bf16 tl.dot needs a GPU: the interpreter's bf16 dot is wrong, so under TRITON_INTERPRET=1 the "
                    "kernel runs fp32 ('ieee') dots even for bf16 tensors")
    q, k, v, cache, meta = _batch(specs, 16, 2, 128, dtype=torch.bfloat16, qpk=4, seed=7, pad_rows=1, device=device)
    plan = plan_attention(q.shape[0], meta.num_seqs, 8, 2, 128, meta.max_query_len, meta.max_seq_len, False)
    assert plan.f32_dot == ""
    out = _check(q, k, v, cache, meta, 128 ** -0.5, window, tol=BF16_TOL, num_splits=num_splits)
    real = (meta.slot_mapping >= 0).cpu()
    err = (out.cpu()[real].double() - _oracle(q, cache, meta, 128 ** -0.5, window)[real]).abs().mean()
    assert err < 5e-3, f"mean |bf16 kernel - fp64 oracle| = {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_to_cache_skips_padding(device, dtype):
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(6, 2, 3, 48, generator=g).to(dtype)       # fused rows: k, v are strided views
    k, v = kv[:, 0], kv[:, 1]
    expected = {c: torch.randn(4, 4, 3, 48, generator=g).to(dtype) for c in "kv"}
    cache = {c: t.to(device) for c, t in expected.items()}
    slots = torch.tensor([5, -1, 0, 15, -1, 9])
    write_to_cache(kv.to(device)[:, 0], kv.to(device)[:, 1], cache, slots.to(device))
    reference.write_to_cache(k, v, expected, slots)             # on the CPU: only there does it skip padding
    for c in "kv":
        assert torch.equal(cache[c].cpu(), expected[c])


def test_write_to_cache_casts_to_the_cache_dtype(device):
    k, v = torch.randn(2, 5, 1, 16).to(device).unbind(0)
    cache = {c: torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16, device=device) for c in "kv"}
    write_to_cache(k, v, cache, torch.tensor([1, 7, -1, 2, 0], device=device))
    got = cache["k"].view(-1, 1, 16)[torch.tensor([1, 7, 2, 0], device=device)].float()
    # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16 ulp apart at most
    torch.testing.assert_close(got, k[[0, 1, 3, 4]], atol=0, rtol=2 ** -7)


def _kv(dtype, device, hkv=2, d=80, seed=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 5, 4, hkv, d, generator=g).to(dtype).to(device)   # [L, C, num_blocks, bs, Hkv, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_chunk_bit_exact(device, dtype):
    kv, slots = _kv(dtype, device), torch.tensor([17, 3, 4, 5, 19, 0, 8], device=device)
    out = torch.empty(3, 2, 7, 2, 80, dtype=dtype, device=device)
    assert gather_chunk(kv, slots, out) is out
    assert torch.equal(out, transfer.gather_chunk(kv, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_scatter_through_staging_views(device, dtype):
    """The publish ring and the load pipe hand both ops a prefix view of one flat buffer (``kernels/staging.py``):
    written in place, bit-exact, nothing past the view touched."""
    kv, slots = _kv(dtype, device), torch.tensor([17, 3, 4], device=device)
    staging = Staging((3, 2), (2, 80), 5, torch.full((3 * 2 * 5 * 2 * 80,), 7.0, dtype=dtype, device=device))
    view = staging.view(3)
    for gather in (gather_chunk, transfer.gather_chunk):
        view.zero_()
        assert gather(kv, slots, view).data_ptr() == view.data_ptr()
        assert torch.equal(view, transfer.gather_chunk(kv, slots))
    assert (staging.flat[view.numel():] == 7).all()
    target, expected = torch.zeros_like(kv), torch.zeros_like(kv)
    scatter_chunk(target, slots, view)
    transfer.scatter_chunk(expected, slots, view)
    assert torch.equal(target, expected) and torch.equal(gather_chunk(target, slots), view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_start", [0, 2])
def test_scatter_chunk_bit_exact_with_tp_head_slice(device, dtype, head_start):
    kv, slots = _kv(dtype, device), torch.tensor([6, 7, 8, 9, 12, 2], device=device)
    obj = torch.randn(3, 2, 6, 4, 80).to(dtype).to(device)     # 4 heads in the object, 2 on this rank
    expected = kv.clone()
    scatter_chunk(kv, slots, obj, head_start)
    transfer.scatter_chunk(expected, slots, obj, head_start)
    assert torch.equal(kv, expected)
    assert torch.equal(gather_chunk(kv, slots), obj[:, :, :, head_start:head_start + 2])


def test_the_start_up_transfer_warmup_touches_nothing(device):
    """``kernel_warmup.warm_transfer`` launches both directions over one skipped slot: the cache is left as it was."""
    from pdserve.engine.runner.kernel_warmup import warm_transfer

    kv = _kv(torch.bfloat16, device)
    before = kv.clone()
    warm_transfer(kv)
    warm_transfer(None)                                  # caches not made by KVLayout.allocate: nothing to do
    assert torch.equal(kv, before)
