"""Review reproductions for the cpu attention backend (kernels/cpu_attention.{c,py}).

Each test passes on correct behaviour and fails on 730ac7c.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from pdserve.kernels import AttentionMetadata, cpu_attention, reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="cpu attention kernel not built here")


def test_a_build_that_leaves_an_unloadable_library_does_not_poison_the_cache(fresh_avx2_load, monkeypatch):
    """A "compiler" that exits 0 without writing a loadable library (CC=true here; a cross compiler or a
    broken wrapper alike) makes load() fall back, fine. But _build() renames mkstemp's empty file onto the
    hash-named target, and every later process -- with a working compiler -- finds target.exists(), dlopen
    fails ("file too short") and it falls back to torch forever (the hash ignores the compiler, and a
    cached library that does not load is never rebuilt)."""
    monkeypatch.setenv("CC", "true")
    assert cpu_attention.load() is None
    cpu_attention.load.cache_clear()
    monkeypatch.delenv("CC")                      # the machine's real cc/gcc from here on
    assert cpu_attention.load() is not None, list((fresh_avx2_load / "kernels").iterdir())


def test_the_cached_kernel_is_private_to_its_user(fresh_avx2_load):
    """A cached library is loaded as code, so the cache is not shared between users (issue 35): even under umask
    000 its folders are made 0700 and the library 0700 -- no other user reads, replaces or plants one. (It was
    made readable by all, in folders the umask left open, for a cache "shared by users".)"""
    old = os.umask(0)
    try:
        assert cpu_attention.load() is not None
    finally:
        os.umask(old)
    [built] = (fresh_avx2_load / "kernels").glob("cpu_attention-*.so")
    modes = [stat.S_IMODE(p.stat().st_mode) for p in (built, built.parent)]
    assert modes == [0o700, 0o700], [oct(m) for m in modes]


def test_int64_host_mirrors_are_not_misread():
    """The torch backend takes query_start_loc_cpu / seq_lens_cpu of any integer dtype (.tolist()), and the
    cpu wrapper converts a non-int32 block_table -- but passes these two straight to C as int32*. Built
    with torch.tensor([...]) (int64 by default) they are read as interleaved (value, 0) pairs: silent NaN
    / wrong rows here, out-of-bounds reads and writes with other values. Not produced by the engine's own
    input batch (int32), but a memory-unsafe answer to an input the other backend accepts."""
    bs, hkv, h, d = 16, 2, 4, 64
    specs = [(40, 13), (30, 1), (57, 1)]
    g = torch.Generator().manual_seed(0)
    cache = {c: torch.randn(16, bs, hkv, d, generator=g) for c in ("k", "v")}
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    meta = AttentionMetadata.build([n for _, n in specs], [s for s, _ in specs], tables, bs, backend="cpu")
    q, k, v = (torch.randn(15, n, d, generator=g) for n in (h, hkv, hkv))
    ref_cache = {c: x.clone() for c, x in cache.items()}
    expected = reference.paged_attention(q, k, v, ref_cache, meta, 0.125)
    meta.query_start_loc_cpu = meta.query_start_loc_cpu.long()
    meta.seq_lens_cpu = meta.seq_lens_cpu.long()
    out = cpu_attention.paged_attention(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
