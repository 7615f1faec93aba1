"""Few-row fp32 matmuls: ``cpu_linear.c`` built like the attention kernel (AVX-512, else AVX2), for decode steps.

    made = prepare(weight, onednn_weight)    # the loader, once per Linear: panels + oneDNN's K block, or None
    y = linear(x, made)                      # engine/models/layers.Linear: 1 .. MAX_ROWS rows, else None

A decode step multiplies a few rows by every weight, so it runs at the speed the weights stream from
memory; oneDNN's fp32 kernels read them at 5-8 GB/s there. This kernel holds each 16 (AVX2: 8) outputs'
weights as one contiguous panel and streams them once: on a Sapphire Rapids Xeon, SmolLM2-135M's layer matmuls
at 16 rows with the weights in DRAM took 28% less time (devbench/cpu_linear.py --layers). Any width N: the last
panel is padded with zeros and its missing outputs are never stored (a 32,001- or 49,152-token LM head).

Bits: each output is the sum oneDNN computes (K in blocks, a block one FMA chain in order, the blocks added
in order). The block size is oneDNN's choice, so ``prepare`` finds it: for each candidate it compares this
kernel with oneDNN on the layer's own weight at several row counts and keeps the first that gives oneDNN's
bits at every one; where none does (another oneDNN, another CPU), it returns None and the layer stays on
oneDNN. So a row's bits are the same whichever path ran it and however many rows shared the step -- one row
included (where this kernel does not run, ``layers`` runs one row as a two-row oneDNN call for the same bits). The two builds give the same bits
(the vectors run across outputs, not along the sum); ``PDSERVE_CPU_ISA=avx2`` makes an AVX-512 CPU run the
AVX2 build. Where the CPU lacks AVX2 or the build fails, ``load`` returns None (logged once) and nothing changes.

The panels are a copy of the weight (beside oneDNN's reordered copy and the original). Thread safety: the
kernel keeps no state; ``prepare``'s result is immutable.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.kernels import cpu_build

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_linear.c")
ISAS = {"avx512vl": (["-mavx512f", "-mavx512vl"], cpu_build.CPU_FLAGS + ("avx512f", "avx512vl")),  # best first
        "avx2": ([], cpu_build.CPU_FLAGS)}                                                            # same bits
SYMBOLS = ("pd_skinny_linear", "pd_skinny_width")   # every symbol _load binds: load_best checks them all
MAX_ROWS = 32                          # above this oneDNN is as fast (devbench/cpu_linear.py --layers)
K_BLOCKS = (512, 1024, 256, 2048)      # oneDNN's fp32 K blocks seen: 512 for K <= 1024, 1024 above
CHECK_ROWS = (2, 3, 8, 17, MAX_ROWS)   # row counts prepare compares at (1 row: the 2-row call's first row)


class Panels(NamedTuple):
    """A weight [N, K] as panels [ceil(N / width), K, width] for the ``isa`` build (the last panel padded with
    zeros) and the K block that gives oneDNN's bits."""
    panels: torch.Tensor
    n: int
    k: int
    k_block: int
    isa: str


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library (``isa``: a key of ISAS; None: the best build this CPU runs, capped by
    ``PDSERVE_CPU_ISA``), or None (reasons logged once) where this CPU or compiler runs none. Its ``isa`` names
    the build."""
    return _load(isa)


@functools.cache
def _load(isa: str | None) -> ctypes.CDLL | None:      # load() and load(None): one cache entry, one log
    lib, name, reasons = cpu_build.load_best(SOURCE, SYMBOLS, ISAS, isa, "few-row linear kernel")
    if lib is None:
        log.info("few-row linear kernel unavailable (%s); decode-step matmuls stay on oneDNN", "; ".join(reasons))
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.pd_skinny_linear.argtypes = [p, i64, p, p, i32, i32, i32, i32]
    lib.pd_skinny_linear.restype = i32
    lib.pd_skinny_width.restype = i32
    lib.isa = name
    return lib


def _run(x: torch.Tensor, made: Panels, k_block: int) -> torch.Tensor:
    y = torch.empty((x.shape[0], made.n), dtype=torch.float32)
    rc = load(made.isa).pd_skinny_linear(x.data_ptr(), x.stride(0) if x.shape[0] > 1 else made.k,
                                         made.panels.data_ptr(), y.data_ptr(), x.shape[0], made.n, made.k, k_block)
    if rc:
        raise RuntimeError(f"cpu few-row linear kernel failed on x {tuple(x.shape)}, weight ({made.n}, {made.k})")
    return y


def make_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width]: each ``width`` outputs' weights contiguous, k-major; the last
    panel's missing outputs zeros."""
    n, k = weight.shape
    padded = torch.zeros((-(-n // width) * width, k), dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.reshape(-1, width, k).transpose(1, 2).contiguous()


def prepare(weight: torch.Tensor, onednn_weight: torch.Tensor | None, bias: torch.Tensor | None = None,
            isa: str | None = None) -> Panels | None:
    """``weight`` [N, K] (fp32, CPU) as panels for the ``isa`` build (None: ``load()``'s) with oneDNN's K block,
    checked against oneDNN (given its reordered copy, or the weight) on seeded rows -- and, given the layer's
    ``bias``, the kernel's result plus the bias against oneDNN's call with it; None where the kernel is
    unavailable or no candidate block gives oneDNN's bits."""
    lib = load(isa)
    if (lib is None or weight.dim() != 2 or weight.numel() == 0 or weight.dtype != torch.float32
            or weight.device.type != "cpu"):
        return None
    n, k = weight.shape
    made = Panels(make_panels(weight, lib.pd_skinny_width()), n, k, 0, lib.isa)
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(n * 131 + k))
    w = weight if onednn_weight is None else onednn_weight
    biases = (None,) if bias is None else (None, bias.detach())
    cases = [(x[:m], b, torch.ops.mkldnn._linear_pointwise(x[:m], w, b, "none", [], "")) for m in CHECK_ROWS
             for b in biases]                                                   # (rows, bias, oneDNN's bits)
    two_rows = next(want for rows, b, want in cases if rows.shape[0] == 2 and b is None)
    cases.append((x[:1], None, two_rows[:1]))                   # one row: oneDNN's 2-row call's first row
    for k_block in K_BLOCKS:
        if all(torch.equal(_add(_run(rows, made, k_block), b), want) for rows, b, want in cases):
            return made._replace(k_block=k_block)
    log.info("few-row linear kernel: no K block gives oneDNN's bits for a (%d, %d) weight; it stays on oneDNN",
             n, k)
    return None


def takes(x: torch.Tensor, made: Panels | None) -> bool:
    """Whether ``linear`` runs ``x``: 1 .. MAX_ROWS plain fp32 CPU rows of the weight's width, unit column stride."""
    return (made is not None and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == made.k
            and x.dtype == torch.float32 and x.device.type == "cpu" and (x.shape[1] == 1 or x.stride(1) == 1)
            and not x.is_neg() and not x._is_zerotensor())


def _add(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y.add_(bias)


def linear(x: torch.Tensor, made: Panels | None, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] W^T (+ bias, added after: the bits of oneDNN's call with it, which ``prepare`` checked for the
    layer's bias) -> [M, N], the bits oneDNN gives those rows; None where ``takes`` says no."""
    return _add(_run(x, made, made.k_block), bias) if takes(x, made) else None
