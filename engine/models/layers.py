"""Building blocks with explicit shard sizes: RMSNorm, Linear, Embedding, the LM head, the gated MLP.

Constructors take the sizes this rank holds; ``load(src, ..., tp_rank)`` reads exactly that
share of the checkpoint through ``WeightSource.get_slice`` (``pdserve.engine.models.loader``). With
``tp_rank=0`` and full sizes (one rank) a shard is the whole tensor. How a Linear is split:

    "column"      W: [out, in] split along out: rank r holds rows [r*out, (r+1)*out) of each
                  fused part (q|k|v, gate|up); bias split the same way
    "row"         split along in: rank r holds columns [r*in, (r+1)*in); full bias (the
                  parallel executor must add it once, after the all-reduce)
    "replicated"  every rank holds the whole tensor

A Linear's ``collective`` (None on one rank) runs on ``x W^T`` before the bias is added: the
tensor-parallel all-reduce of a row-parallel layer, the all-gather of a vocab-parallel LM head
(``pdserve.engine.parallel.tp`` sets them). ``Embedding`` may hold a vocab shard the same way.

``Embedding`` and ``LMHead`` hold a padded vocabulary's shard where V does not divide by tp (``vocab.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import envs
from pdserve.engine.models.vocab import vocab_rows
from pdserve.kernels import cpu_linear, cpu_ops, fused_ops


# fp32 matmuls on CPU go to oneDNN: it uses the CPU's widest vectors, where MKL runs its AVX2 code on non-Intel
# CPUs (an AVX-512 EPYC: 2.2x faster at 256-2048 rows, 1.2-1.9x at 32; devbench/cpu_linear.py). A row's bits are
# then the same for any row count >= 2 (MKL's change up to 3 rows), so how a prompt is chunked, or how many
# requests share a decode step, does not change them -- which the store's digest check and a request's logprobs
# rely on. oneDNN's 1-row path rounds differently, so one row runs as a two-row call whose first row is kept
# (``_onednn``): the bits of that row in any bigger call (where the few-row kernel runs, it gives them itself).
# 2-row calls are 6-28% slower on oneDNN (SmolLM2's layers; 3 rows already win): a small decode step pays that
# so that the bits stay put.
ONEDNN_MIN_ROWS = 1
_ONEDNN = envs.PDSERVE_CPU_LINEAR == "onednn" and torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise")
# ``Linear`` hands oneDNN its weight reordered once into oneDNN's blocked layout, where an unreordered weight is
# reordered inside every call: a decode step of SmolLM2-135M's 30 layers at 16 rows, weights streaming from
# DRAM, 65.9 -> 43.1 ms; 32 rows 94.7 -> 72.6; 2048 rows -4% (a Zen 4 EPYC, devbench/cpu_linear.py --layers). The result
# is bit-identical to the unreordered call for any row count >= 2 (tests/test_cpu_linear.py). The reorder is a
# second copy of the weight (the original stays: 1-row calls, torch.compile and the GPU read it), made by the
# loader (``reorder_linears``: the first step paid 26 ms of reorders on the tiny model otherwise). The batch
# size it is tuned for measured the same from 16 to 2048 rows.
_REORDER_ROWS = 256


def matmul_path(dtype: torch.dtype, device: str, compiled: bool = False) -> str:
    """What ``linear`` runs for activations of ``dtype`` on ``device`` (the engine's start-up log); ``compiled``:
    the layers run torch.compile'd for big steps, where inductor picks the GEMM."""
    eager = "onednn (one row as two)" if _ONEDNN and dtype == torch.float32 and device == "cpu" else "F.linear"
    if eager.startswith("onednn") and cpu_linear.load() is not None:
        eager = f"few-row kernel (1-{cpu_linear.MAX_ROWS} rows, oneDNN's bits), else onednn"
    return f"inductor in compiled steps, else {eager}" if compiled else eager


def onednn_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` sends ``x`` to oneDNN: fp32 CPU batches of >= ONEDNN_MIN_ROWS rows against an fp32 CPU
    weight, run eagerly. (Given a weight of another dtype, oneDNN fails with a primitive-descriptor error;
    F.linear's names the dtypes.)"""
    # compiled (--torch-compile): inductor lowers this op only for frozen weights; it picks its own GEMM
    return (_ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] >= ONEDNN_MIN_ROWS and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), x: [T, in]; oneDNN for fp32 CPU batches, else F.linear.
    (``Linear`` decides the same way but hands oneDNN its reordered weight.)"""
    if onednn_takes(x, weight):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x W^T (+ b); one row as the first row of a two-row call (oneDNN's one-row path rounds
    differently from its many-row path; the two-row call gives the row the bits it has in any batch)."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x]), weight, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def reorder_linears(model: nn.Module) -> tuple[int, int, int]:
    """Make every ``Linear``'s reordered copy and few-row panels now (the loader calls it once the weights are
    in place, so no request pays for them: SmolLM2-135M's take ~1.4 s, ~0.35 s of it the oneDNN reorders);
    -> (weights done, bytes of oneDNN's copies, bytes of panels). None made where oneDNN is off or the weights
    are not fp32 on the CPU."""
    made = nbytes = panel_bytes = 0
    if not _ONEDNN:
        return made, nbytes, panel_bytes
    for module in model.modules():
        copies = module._copies() if isinstance(module, Linear) else None
        if copies is not None:
            made, nbytes = made + 1, nbytes + module.weight.numel() * module.weight.element_size()
            panel_bytes += 0 if copies[4] is None else copies[4].panels.numel() * 4
    return made, nbytes, panel_bytes


def reorder_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in], fp32, CPU) in oneDNN's blocked layout: a copy, for ``Linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _REORDER_ROWS)


class RMSNorm(nn.Module):
    """y = w * x / rms(x), normalised in float32 like HF (``x`` cast back before the weight)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]; CUDA: one Triton kernel (kernels/fused_ops.py: its switch); float32 [N, size] on CPU,
        # eager: one C call (kernels/cpu_ops.c)
        if fused_ops.norm_on(x):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
            y = cpu_ops.rms_norm(x, self.weight, self.eps)
            if y is not None:
                return y
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(self, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s), s) for s = residual + x (s = residual where x is None): the residual add and this norm as
        one Triton kernel where ``fused_ops.norm_on`` (vLLM's fused_add_rms_norm), else the two ops. Called by
        ``DecoderLayer.forward_fused`` and the model's final norm on that path."""
        if x is None:
            return self(residual), residual
        if fused_ops.norm_on(x):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        s = residual + x
        return self(s), s

    def load(self, src, name: str) -> None:
        _copy(self.weight, src.get(f"{name}.weight"), f"{name}.weight")


class Linear(nn.Module):
    """y = x W^T (+ b) with W: [sum(out_sizes), in_size], this rank's shard.

    ``out_sizes``: the rows of each checkpoint matrix fused into this one (e.g. q, k, v)."""

    def __init__(self, in_size: int, out_sizes: int | Sequence[int], bias: bool,
                 dtype: torch.dtype, split: str = "column"):
        super().__init__()
        if split not in ("column", "row", "replicated"):
            raise ValueError(f"split {split!r} is not one of column, row, replicated")
        self.in_size, self.split = in_size, split
        self.out_sizes = (out_sizes,) if isinstance(out_sizes, int) else tuple(out_sizes)
        out = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        self.collective = None          # tensor parallel: all-reduce (row) or all-gather (LM head)
        self._reordered = None          # (weight, alias of its data, key, oneDNN's copy, the few-row panels or
                                        # None): _onednn_weight
        self._generation = 0            # forget_reordered's count: a copy begun before the last forget is stale
        self._split_qkv = None          # (copies, q size, bias key, SplitQKV or None): split_qkv.SplitQKV.of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out] (after an all-gather: [T, out * tp])
        bias = self.bias if self.collective is None else None
        y = self._few_rows(x, bias)
        if y is None and onednn_takes(x, self.weight):
            reordered = self._onednn_weight()
            y = _onednn(x, self.weight if reordered is None else reordered, bias)
        elif y is None:
            y = F.linear(x, self.weight, bias)
        if self.collective is None:
            return y
        y = self.collective(y)
        return y if self.bias is None else y + self.bias

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b): the bits of ``residual + self(x)``. A prompt's rows on oneDNN (no bias, no
        collective) take the add as the matmul's post-op, one pass over the output fewer (a 2048-token step of
        the tiny model: 6 adds, ~1 ms); tests/test_cpu_linear.py compares the bits at 2..2048 rows."""
        if (self.bias is None and self.collective is None and x.dim() == 2 and x.shape[0] > cpu_linear.MAX_ROWS
                and onednn_takes(x, self.weight) and residual.dtype == torch.float32
                and residual.shape == (x.shape[0], self.weight.shape[0]) and residual.is_contiguous()):
            reordered = self._onednn_weight()
            if reordered is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, reordered, None, "add")
        return residual + self(x)

    def _few_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x W^T (+ bias) through the few-row kernel (``kernels/cpu_linear.py``), or None where it does not run:
        not fp32 on the CPU, compiled, oneDNN off, more than MAX_ROWS rows, or no panels (``_copies``); the
        kernel's ``takes`` checks the rest."""
        if not (_ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
                and x.shape[0] <= cpu_linear.MAX_ROWS and not torch.compiler.is_compiling()):
            return None
        copies = self._copies()
        return None if copies is None else cpu_linear.linear(x, copies[4], bias)

    def rows_independent(self) -> bool:
        """Whether each row's result has the same bits at any row count: fp32 on oneDNN with the few-row kernel's
        panels (1-32 rows; ``cpu_linear.prepare`` checked their bits against oneDNN's). Not so for F.linear
        (MKL, ``PDSERVE_CPU_LINEAR=torch``), half precision, or a weight with no matching panels."""
        copies = self._copies() if _ONEDNN and self.collective is None else None
        return copies is not None and copies[4] is not None

    def _onednn_weight(self) -> torch.Tensor | None:
        """The weight reordered for oneDNN (``_copies``), or None."""
        copies = self._copies()
        return None if copies is None else copies[3]

    def _copies(self) -> tuple | None:
        """The weight reordered for oneDNN and its few-row panels: made by the loader (or the first call), and again when the weight
        was replaced, re-pointed, re-strided or written in place since. The key is the weight object, its data
        pointer, strides, shape and version counter; the cache holds an alias of the old data, so freed memory
        cannot come back at the same address and pass for it. Two writes leave no trace in that key --
        through ``.data`` (its own version counter) and to an inference tensor (none) -- so ``load`` and the
        model's ``load_weights`` call ``forget_reordered`` themselves; its generation count is in the key too,
        so a copy another thread began before the forget is not taken afterwards. None (and no copy kept) unless the
        weight is fp32 on the CPU. Threads running one model may both make it: the copies are equal, and the
        cache is swapped in as one tuple (oneDNN's copy and the few-row panels together), read once a call, so no
        call pairs one weight's key with another's copy. -> the cached tuple (``_reordered``)."""
        w = self.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            self._reordered = None
            return None
        key = (self._generation, w.data_ptr(), w.stride(), w.shape, -1 if w.is_inference() else w._version)
        cached = self._reordered
        if cached is None or cached[0] is not w or cached[2] != key:
            reordered = reorder_for_onednn(w)
            cached = (w, w.detach(), key, reordered, cpu_linear.prepare(w, reordered, self.bias))
            self._reordered = cached
        return cached

    def forget_reordered(self) -> None:
        """Drop the reordered copy: the next call makes it from the weight as it is then. A call that began its
        copy before this (another thread, reading the weight while it was being written) stores it under the
        old generation, which no later call accepts."""
        self._generation += 1
        self._reordered = None
        self._split_qkv = None          # split_qkv.SplitQKV's parts: views of the weight as it was

    def _apply(self, fn, recurse=True):
        self.forget_reordered()             # .to(), .half(), .cuda(): the copy is of the weight before it
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__()      # copy.deepcopy and pickle: oneDNN's copy has no storage to copy
        return {**state, "_reordered": None, "_split_qkv": None}

    def load(self, src, names: str | Sequence[str], tp_rank: int = 0) -> None:
        """Fill from checkpoint modules ``names`` (one per fused part, HF prefixes)."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) != len(self.out_sizes):
            raise ValueError(f"Linear fuses {len(self.out_sizes)} parts but got names {names}")
        weights = [self._read(src, f"{n}.weight", rows, tp_rank) for n, rows in zip(names, self.out_sizes)]
        _copy(self.weight, torch.cat(weights), f"{names[0]}.weight")
        self.forget_reordered()
        if self.bias is not None:
            biases = [self._read(src, f"{n}.bias", rows, tp_rank) for n, rows in zip(names, self.out_sizes)]
            _copy(self.bias, torch.cat(biases), f"{names[0]}.bias")

    def _read(self, src, name: str, rows: int, tp_rank: int) -> torch.Tensor:
        is_bias = name.endswith(".bias")
        if self.split == "column":
            return src.get_slice(name, 0, tp_rank * rows, (tp_rank + 1) * rows)
        if self.split == "row" and not is_bias:
            return src.get_slice(name, 1, tp_rank * self.in_size, (tp_rank + 1) * self.in_size)
        return src.get(name)


class Embedding(nn.Module):
    """Token id -> row of the embedding table ``[vocab, hidden]``; ``rows`` is this rank's rows, ``vocab_size`` the
    checkpoint's (default ``rows``: one rank).

    Vocab-parallel (``collective`` set): rank r holds rows [r*R, (r+1)*R) of the padded table (``padded_vocab``;
    rows past ``vocab_size`` are zeros); ids outside give zeros and the all-reduce sums the ranks' rows, so every
    rank ends with the full embedding."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, vocab_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
        self.vocab_size = rows if vocab_size is None else vocab_size
        self.vocab_start = 0
        self.collective = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D]
        if self.collective is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.collective(rows)

    def load(self, src, name: str, tp_rank: int = 0) -> None:
        rows = self.weight.shape[0]
        self.vocab_start = tp_rank * rows
        _copy(self.weight, vocab_rows(src, f"{name}.weight", self.vocab_start, rows, self.vocab_size),
              f"{name}.weight")


class LMHead(Linear):
    """hidden -> logits over the vocabulary, no bias; ``rows`` this rank's share of the padded vocabulary
    (``padded_vocab``), ``vocab_size`` the checkpoint's. Rows past ``vocab_size`` load as zeros, and the logits
    come back with exactly ``vocab_size`` columns: on one rank its own, at tp > 1 the all-gather's
    (``collective``) with the padding's columns cut off (a contiguous copy)."""

    def __init__(self, hidden_size: int, rows: int, dtype: torch.dtype, vocab_size: int | None = None):
        super().__init__(hidden_size, rows, False, dtype, "column")
        self.vocab_size = rows if vocab_size is None else vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N, vocab_size]
        y = super().forward(x)                                   # [N, rows], or [N, rows * tp] gathered
        return y[:, :self.vocab_size].contiguous() if y.shape[-1] > self.vocab_size else y

    def _read(self, src, name: str, rows: int, tp_rank: int) -> torch.Tensor:
        return vocab_rows(src, name, tp_rank * rows, rows, self.vocab_size)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); ``intermediate_size`` is this rank's share."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = Linear(hidden_size, (intermediate_size, intermediate_size), bias, dtype, "column")
        self.down = Linear(intermediate_size, hidden_size, bias, dtype, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> gate_up: [T, 2I] -> [T, I] -> [T, D]
        return self.down(self._act(x))

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x), the add fused into ``down`` where it can be (``Linear.plus``)."""
        return self.down.plus(self._act(x), residual)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> gate_up: [T, 2I] -> silu(gate) * up: [T, I]
        gate_up = self.gate_up(x)
        if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and not torch.compiler.is_compiling():
            y = cpu_ops.silu_and_mul(gate_up)                        # one C pass (kernels/cpu_ops.c)
            if y is not None:
                return y
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up

    def rows_independent(self) -> bool:
        """Whether a row's result has the same bits at any row count (``Linear.rows_independent``, both matmuls)."""
        return self.gate_up.rows_independent() and self.down.rows_independent()

    def load(self, src, prefix: str, tp_rank: int = 0) -> None:
        self.gate_up.load(src, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), tp_rank)
        self.down.load(src, f"{prefix}.down_proj", tp_rank)


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}; "
                         f"the model expects {tuple(param.shape)} (config.json does not match the weights?)")
    with torch.no_grad():
        param.copy_(value)
