"""The ``cpu`` attention kernel (kernels/cpu_attention.c) equals the float64 oracle and the torch reference,
and a row's bits do not depend on how its prompt was chunked, what else was in the call, or which thread ran it.

Ragged steps over scrambled block tables: chunked prefill on cached context, first chunks, decodes of mixed
lengths; GQA 1-4 query heads per KV head; head sizes 8-128 (64 and 128 have their own unrolled variants);
block sizes 8-32; float32, bfloat16 and float16 caches; sliding windows. The chunking property runs
under hypothesis: any cut of a prompt into chunks, each chunk a step of its own and decodes mixed in,
gives each position exactly the bits the one-chunk prefill gave it. The numerical tests run on every
build this CPU takes (avx2, and avx512vl where it has AVX-512VL), and the two builds agree bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kernels import AttentionMetadata, cpu_attention, cpu_build, reference, resolve_backend
from pdserve.kernels.dispatch import paged_attention

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="cpu attention kernel not built here "
                                "(needs x86-64 with AVX2/FMA/F16C and a C compiler)")
NUM_BLOCKS = 96
BUILDS = [isa for isa in cpu_attention.ISAS if cpu_attention.load(isa) is not None]


@pytest.fixture(params=BUILDS)
def each_build(request, monkeypatch):
    """paged_attention calls the ``request.param`` build of the kernel in this test."""
    lib = cpu_attention.load(request.param)
    monkeypatch.setattr(cpu_attention, "load", lambda isa=None: lib)
    return request.param


def _step(specs, H, HKV, D, BS, dtype=torch.float32, seed=0):
    """specs [(seq_len, q_len)] -> (cache, tables, meta, q, k, v); K/V of every cached position random."""
    g = torch.Generator().manual_seed(seed)
    cache = {c: torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(dtype) for c in ("k", "v")}
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[perm.pop() for _ in range((s + BS - 1) // BS)] for s, _ in specs]
    meta = AttentionMetadata.build([n for _, n in specs], [s for s, _ in specs], tables, BS, backend="cpu")
    T = sum(n for _, n in specs)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, HKV, HKV))
    return cache, tables, meta, q, k, v


def _oracle(cache, tables, specs, q, scale, window, BS):
    """Each sequence's rows attended in float64 over its K/V read back from the (already written) cache."""
    HKV, D = cache["k"].shape[2:]
    flat = {c: cache[c].view(-1, HKV, D).double() for c in cache}
    out, row = [], 0
    for (s, n), t in zip(specs, tables):
        pos = torch.arange(s)
        slots = torch.tensor(t)[pos // BS] * BS + pos % BS
        k, v = (flat[c][slots].repeat_interleave(q.shape[1] // HKV, 1).transpose(0, 1) for c in ("k", "v"))
        qp, kp = torch.arange(s - n, s).unsqueeze(1), pos.unsqueeze(0)
        mask = (kp <= qp) & ((kp > qp - window) if window else True)
        scores = (q[row:row + n].double().transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        row += n
    return torch.cat(out)


SPECS = [(40, 13), (9, 9), (30, 1), (1, 1), (57, 1), (16, 16), (24, 8)]


@pytest.mark.parametrize("H,HKV", [(4, 4), (4, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("D,BS", [(64, 16), (128, 8), (8, 32), (24, 16)])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.usefixtures("each_build")
def test_equals_float64_oracle(H, HKV, D, BS, window):
    cache, tables, meta, q, k, v = _step(SPECS, H, HKV, D, BS)
    out = cpu_attention.paged_attention(q, k, v, cache, meta, 0.3, window)
    torch.testing.assert_close(out.double(), _oracle(cache, tables, SPECS, q, 0.3, window, BS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.usefixtures("each_build")
def test_half_caches_equal_the_torch_reference(dtype, tol):
    cache, _, meta, q, k, v = _step(SPECS, 4, 2, 64, 16, dtype=dtype)
    ref_cache = {c: x.clone() for c, x in cache.items()}
    out = cpu_attention.paged_attention(q, k, v, cache, meta, 0.125)
    assert out.dtype == dtype
    expected = reference.paged_attention(q, k, v, ref_cache, meta, 0.125)
    assert torch.equal(cache["k"], ref_cache["k"]) and torch.equal(cache["v"], ref_cache["v"])
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def _prefill_in_chunks(q, k, v, cuts, decode_after, BS, window=None, neighbours=()):
    """One prompt (q/k/v [L, *, D]) run as the chunks cuts say, each chunk a step with ``neighbours``
    (other sequences' (seq_len, q_len)) in the same call; the last ``decode_after`` positions as decodes."""
    L, HKV, D = k.shape
    cache = {c: torch.zeros(NUM_BLOCKS, BS, HKV, D) for c in ("k", "v")}
    table = list(range((L + BS - 1) // BS))
    other_tables = [list(range(NUM_BLOCKS - 1 - (s + BS - 1) // BS, NUM_BLOCKS - 1)) for s, _ in neighbours]
    bounds = [0, *cuts, L - decode_after] + list(range(L - decode_after + 1, L + 1))
    out = []
    for start, end in zip(bounds, bounds[1:]):
        if end <= start:
            continue
        specs = [(end, end - start), *neighbours]
        meta = AttentionMetadata.build([n for _, n in specs], [s for s, _ in specs], [table, *other_tables], BS,
                                       backend="cpu")
        extra = sum(n for _, n in neighbours)
        pad = lambda x: torch.cat([x[start:end], torch.ones(extra, *x.shape[1:])])   # noqa: E731
        o = cpu_attention.paged_attention(pad(q), pad(k), pad(v), cache, meta, 0.125, window)
        out.append(o[: end - start])
    return torch.cat(out)


@pytest.mark.usefixtures("each_build")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(2, 90), data=st.data())
def test_a_rows_bits_do_not_depend_on_chunking(L, data):
    """Any chunking of a prompt (and its last positions run as decodes, with other sequences in the call)
    gives every position the same bits as one chunk: what lets two engines publish identical KV bytes."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, L - 1), max_size=4)))) if L > 1 else []
    decode_after = data.draw(st.integers(0, min(3, L - 1 - (cuts[-1] if cuts else 0))))
    neighbours = data.draw(st.sampled_from([(), ((20, 1),), ((33, 5), (3, 1))]))
    window = data.draw(st.sampled_from([None, 9]))
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(L, h, 64, generator=g) for h in (6, 2, 2))
    whole = _prefill_in_chunks(q, k, v, [], 0, 16, window)
    chunked = _prefill_in_chunks(q, k, v, cuts, decode_after, 16, window, neighbours)
    assert torch.equal(whole, chunked), (cuts, decode_after, neighbours)


@pytest.mark.usefixtures("each_build")
def test_threads_calling_at_once_get_the_serial_bits():
    """ctypes drops the GIL for the call and the kernel keeps no state: 4 threads x 20 calls on their own
    steps give exactly what each step gives alone."""
    steps = [_step(SPECS, 4, 2, 64, 16, seed=s) for s in range(4)]
    serial = [cpu_attention.paged_attention(q, k, v, c, m, 0.125) for c, _, m, q, k, v in steps]
    results: dict[int, list] = {i: [] for i in range(4)}

    def work(i):
        c, _, m, q, k, v = steps[i]
        for _ in range(20):
            results[i].append(cpu_attention.paged_attention(q, k, v, c, m, 0.125))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, serial[i]) for i in range(4) for r in results[i])


@pytest.mark.usefixtures("each_build")
def test_torch_threads_share_the_call_out_without_changing_a_bit():
    """torch.get_num_threads() > 1: the (tile, KV head) items go to OpenMP threads; same bits as one thread."""
    cache, _, meta, q, k, v = _step(SPECS + [(90, 90), (70, 35)], 6, 2, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_attention(q, k, v, cache, meta, 0.125)
        torch.set_num_threads(2)
        two = [cpu_attention.paged_attention(q, k, v, cache, meta, 0.125) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, t) for t in two)


def test_the_dispatcher_picks_cpu_on_a_cpu_and_torch_for_caches_it_does_not_take(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)
    assert resolve_backend(None, "cpu") == "cpu"
    with pytest.raises(ValueError, match="--attention-backend cpu needs a CPU"):
        resolve_backend("cpu", "cuda")
    specs = [(10, 10), (7, 1)]                       # block size 4: not a multiple of 8
    cache, tables, meta, q, k, v = _step(specs, 4, 2, 16, 4)
    assert not cpu_attention.supports(cache)
    out = paged_attention(q, k, v, cache, meta, 0.3)
    assert "torch" in meta.derived                   # the reference planned the step
    torch.testing.assert_close(out.double(), _oracle(cache, tables, specs, q, 0.3, None, 4), rtol=1e-5, atol=1e-5)


def test_a_bad_shape_is_an_error_naming_it_not_a_crash():
    cache, _, meta, q, k, v = _step([(9, 9)], 4, 2, 12, 16)       # head size 12: not a multiple of 8
    with pytest.raises(RuntimeError, match="head size and block size must be multiples of 8"):
        cpu_attention.paged_attention(q, k, v, cache, meta, 0.3)


def test_the_library_is_built_once_and_reused(fresh_avx2_load, monkeypatch):
    """The second load (a new process, say) finds the cached library for this source and flags and compiles
    nothing; the key leaves the compiler out (looked up before one is needed), so another compiler reuses it."""
    import subprocess

    compiles, run = [], subprocess.run

    def counting_run(cmd, *a, **kw):
        compiles.extend([cmd] if "-o" in cmd else [])
        return run(cmd, *a, **kw)

    monkeypatch.setattr(cpu_build.subprocess, "run", counting_run)
    assert cpu_attention.load() is not None and len(compiles) == 1
    cpu_attention.load.cache_clear()
    assert cpu_attention.load() is not None and len(compiles) == 1
    assert len(list((fresh_avx2_load / "kernels").glob("cpu_attention-*.so"))) == 1
    cpu_attention.load.cache_clear()
    monkeypatch.setenv("CC", "gcc" if cpu_build.compiler() != ["gcc"] else "cc")
    assert cpu_attention.load() is not None and len(compiles) == 1


@pytest.mark.parametrize("how", ["no compiler", "the build fails"])
def test_without_a_working_compiler_the_cpu_falls_back_to_torch(fresh_load, monkeypatch, caplog, how):
    if how == "no compiler":
        monkeypatch.setenv("PATH", str(fresh_load))  # nothing to run there
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", "false")
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)
    assert cpu_attention.load() is None
    assert "using the plain-torch backend" in caplog.text
    assert resolve_backend(None, "cpu") == "torch"
    with pytest.raises(ValueError, match="use torch"):
        resolve_backend("cpu", "cpu")


def test_the_best_build_the_cpu_runs_is_the_default():
    flags = cpu_build.cpu_flags()
    best = "avx512vl" if {"avx512f", "avx512vl"} <= flags else "avx2"
    assert cpu_attention.load()._name == cpu_attention.load(best)._name
    if best == "avx2":
        assert cpu_attention.load("avx512vl") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,HKV,D,BS,window", [(4, 2, 64, 16, None), (6, 2, 128, 8, 11), (8, 2, 24, 16, None),
                                               (4, 4, 8, 32, 5)])
def test_the_builds_give_the_same_bits(monkeypatch, dtype, H, HKV, D, BS, window):
    """The avx512vl build is the same source with 32 registers: engines on AVX2-only and AVX-512 CPUs must
    publish the same KV and answer the same tokens. Mutation caught: a build that widens a vector or
    reorders a sum (an AVX-512 variant tried this way differed in the last bits)."""
    if len(BUILDS) < 2:
        pytest.skip("this CPU runs the avx2 build only")
    outs = []
    for isa in BUILDS:
        cache, _, meta, q, k, v = _step(SPECS + [(90, 90)], H, HKV, D, BS, dtype=dtype, seed=D)
        lib = cpu_attention.load(isa)
        monkeypatch.setattr(cpu_attention, "load", lambda isa=None, lib=lib: lib)
        outs.append(cpu_attention.paged_attention(q, k, v, cache, meta, 0.3, window))
        monkeypatch.undo()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_compiler_without_the_avx512_flags_falls_back_to_the_avx2_build(fresh_load, monkeypatch, caplog):
    """Where -mavx512vl does not build (an old compiler), the default is the avx2 build, not plain torch."""
    if len(BUILDS) < 2:
        pytest.skip("this CPU runs the avx2 build only")
    import subprocess

    run = subprocess.run

    def no_avx512(cmd, *a, **kw):
        if "-mavx512vl" in cmd:
            raise subprocess.CalledProcessError(1, cmd, stderr=b"cc: error: unrecognized option '-mavx512vl'")
        return run(cmd, *a, **kw)

    monkeypatch.setattr(cpu_build.subprocess, "run", no_avx512)
    lib = cpu_attention.load()
    assert lib is not None and lib._name == cpu_attention.load("avx2")._name
    assert "the avx512vl build is unavailable" in caplog.text and "plain-torch" not in caplog.text


def test_the_prefetch_distance_follows_the_vendor_and_changes_no_bit(fresh_load, monkeypatch):
    """Intel builds ask for unit 2 ahead only, others for units 2-4 (devbench/cpu_kv_memory.py); the prefetches
    are hints, so both builds give the same bits. Mutation caught: a distance that reaches the arithmetic."""
    outs = []
    for vendor, ahead in (("GenuineIntel", 2), ("AuthenticAMD", 4), (None, 4)):
        monkeypatch.setattr(cpu_attention, "cpu_vendor", lambda v=vendor: v)
        assert cpu_attention.prefetch_flags() == [f"-DAHEAD={ahead}"]
        cpu_attention.load.cache_clear()
        cache, _, meta, q, k, v = _step(SPECS + [(300, 1), (200, 1), (129, 64)], 4, 2, 64, 16, seed=5)
        outs.append(cpu_attention.paged_attention(q, k, v, cache, meta, 0.125, None))
    assert len(list((fresh_load / "kernels").glob("cpu_attention-*.so"))) >= 2     # two builds, not one reused
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,HKV,D,BS,window", [(4, 2, 64, 16, None), (6, 2, 128, 16, 70), (8, 2, 24, 16, None),
                                               (3, 3, 8, 32, None), (9, 3, 64, 16, 45)])
def test_the_avx2_blocks_of_two_lanes_change_no_bit(monkeypatch, dtype, H, HKV, D, BS, window):
    """The AVX2 build takes the lanes that see a whole unit two at a time (one K/V load for both); built with
    -DPD_ONE_LANE_AT_A_TIME every lane runs alone. Prompts long enough for units below the diagonal, odd lane
    counts (a lane left over), windows, decode rows. Mutation caught: a block whose P @ V visits the keys in
    another order, or whose scores pair other partial sums."""
    lib = cpu_attention.load("avx2")
    alone = cpu_attention._bind(cpu_build.build(cpu_attention.SOURCE, cpu_attention.SYMBOLS,
                                                cpu_attention.prefetch_flags() + ["-DPD_ONE_LANE_AT_A_TIME"]))
    specs = [(300, 300), (200, 137), (129, 64), (90, 90), (500, 1), (40, 13), (97, 1)]
    outs = []
    for build in (lib, alone):
        cache, _, meta, q, k, v = _step(specs, H, HKV, D, BS, dtype=dtype, seed=H + D)
        monkeypatch.setattr(cpu_attention, "load", lambda isa=None, build=build: build)
        outs.append(cpu_attention.paged_attention(q, k, v, cache, meta, 0.2, window))
        monkeypatch.undo()
    bits = [o.view(torch.int32 if o.element_size() == 4 else torch.int16) for o in outs]   # -0.0 is not 0.0
    assert torch.equal(bits[0], bits[1])
