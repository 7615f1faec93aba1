"""The ``cpu`` attention backend: ``cpu_attention.c`` built with the machine's C compiler, called through ctypes.

    lib = load()                       # once per process: compile (cached by source hash) and dlopen, or None
                                       # (the avx512vl build where the CPU has it, else avx2; load("avx2") picks)
    out = paged_attention(q, k, v, cache, meta, scale, window)   # each layer: write K/V, one C call

The kernel reads the paged cache through the block tables directly (no gather, no mask tensor) and
takes every sequence of the step, prefill chunks and decode rows, in one call per layer; its results
do not depend on how a prompt was chunked (see the C file's header), so engines that chunk one prompt
differently still publish identical KV bytes. ctypes drops the GIL for the call, and the kernel keeps
no state between calls: engines on several threads call it at once. With ``torch.get_num_threads()`` > 1
the call shares its (row tile, KV head) items among that many OpenMP threads; the bits stay the same.

Built at ``PDSERVE_CACHE_DIR/kernels/cpu_attention-<hash>.so`` (the hash covers the source, its headers and the
flags; the cache is private to the user, ``cpu_cache.py``) with ``cc -O3 -mavx2 -mfma -mf16c -ffp-contract=off
-fopenmp``, plus ``-mavx512f -mavx512vl`` on CPUs that have them: each lane's arithmetic is the AVX2 build's 8-float
arithmetic, so the same bits (tests/test_cpu_attention.py compares the two builds bit for bit), but 32
vector registers instead of 16 -- no spills (an AVX-512 EPYC: prompt steps 10-20% and decode steps ~23%
faster, ``devbench/cpu_attention.py``) -- and two lanes in each 16-float register, each K/V load shared by
every lane of a block (a Sapphire Rapids Xeon: a 512-token prompt's layer 2.28 -> ~1.8 ms, a 32-row decode
step's 1.39 -> 1.34). The AVX2 build shares each K/V load between two lanes of a prompt's rows below the
diagonal (the same per-lane arithmetic: tests build the source with ``-DPD_ONE_LANE_AT_A_TIME`` and compare):
a Zen 3 EPYC's 512-token prompt layer, 4 prompts, 17.1 -> 15.3 ms.
``cpu_build.py`` compiles and caches each build. ``load()`` returns None — and the dispatcher keeps the
plain-torch backend — when the CPU lacks AVX2/FMA/F16C, or no usable build is cached and there is no compiler or
the build fails; the reason is logged in one line.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pdserve.kernels import cpu_ops
from pdserve.kernels.cpu_build import CPU_FLAGS, cpu_vendor, load_best
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.reference import write_to_cache

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.c")
ISAS = {"avx512vl": (["-mavx512f", "-mavx512vl"], CPU_FLAGS + ("avx512f", "avx512vl")),   # best first; same bits
        "avx2": ([], CPU_FLAGS)}
SYMBOLS = ("pd_paged_attention",)            # every symbol _bind binds: load checks them all
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERRORS = {1: "shape (head size and block size must be multiples of 8, query heads a multiple of KV heads)",
           2: "out of memory"}


# units a decode row's prefetch runs ahead, by CPU vendor (devbench/cpu_kv_memory.py; prefetches change no bits):
# 2..4 on a Zen 4 EPYC (1.50-1.63 -> 1.25-1.31 ms a layer), unit 2 only on a Sapphire Rapids Xeon (1.76-1.95 ->
# 1.44-1.55 ms: the extra requests cost more than they bring there)
PREFETCH_AHEAD = {"GenuineIntel": 2}
DEFAULT_AHEAD = 4


def prefetch_flags() -> list[str]:
    """The build's -DAHEAD for this machine's CPU vendor (/proc/cpuinfo), DEFAULT_AHEAD where unknown."""
    return [f"-DAHEAD={PREFETCH_AHEAD.get(cpu_vendor(), DEFAULT_AHEAD)}"]


@functools.cache
def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library (``isa``: a key of ISAS; None: the best build this CPU runs and this compiler
    builds, capped by ``PDSERVE_CPU_ISA``, avx2 if the other fails), or None (with the reasons logged) where none
    can be built here."""
    lib, _, reasons = load_best(SOURCE, SYMBOLS, ISAS, isa, "cpu attention kernel", prefetch_flags())
    if lib is None:
        log.warning("cpu attention kernel unavailable (%s); using the plain-torch backend", "; ".join(reasons))
    return None if lib is None else _bind(lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.pd_paged_attention.argtypes = [p, p, p, p, i32, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32,
                                       i32]
    lib.pd_paged_attention.restype = i32
    return lib


def supports(cache: dict) -> bool:
    """Whether the kernel takes this cache (dtype, head size, block size); else the caller uses torch. An MLA
    latent cache (no "k") is never this kernel's."""
    if "k" not in cache:
        return False
    k = cache["k"]
    v = cache["v"]
    return (k.device.type == "cpu" and k.dtype in CACHE_DTYPES and v.dtype == k.dtype and v.shape == k.shape
            and k.is_contiguous() and v.is_contiguous() and k.shape[-1] % 8 == 0 and k.shape[1] % 8 == 0)


def paged_attention(q, k, v, cache: dict, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H, D] in q's dtype (computed in float32)."""
    if not cpu_ops.write_kv(k, v, cache, meta.slot_mapping):    # float32 caches: one C pass
        write_to_cache(k, v, cache, meta.slot_mapping)
    lib = load()
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    kc, vc = cache["k"], cache["v"]
    table = meta.block_table if meta.block_table.dtype == torch.int32 else meta.block_table.to(torch.int32)
    table = table.contiguous()
    qsl, lens = (x.to(torch.int32).contiguous() for x in (meta.query_start_loc_cpu, meta.seq_lens_cpu))
    _, bs, hkv, d = kc.shape
    rc = lib.pd_paged_attention(qf.data_ptr(), out.data_ptr(), kc.data_ptr(), vc.data_ptr(), CACHE_DTYPES[kc.dtype],
                                table.data_ptr(), table.stride(0), qsl.data_ptr(), lens.data_ptr(), lens.numel(),
                                q.shape[1], hkv, d, bs, float(scale), int(sliding_window or 0), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"cpu attention kernel failed: {_ERRORS.get(rc, rc)} (q {tuple(q.shape)}, "
                           f"cache {tuple(kc.shape)} {kc.dtype})")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
