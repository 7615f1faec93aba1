"""The routed experts of an MoE layer in plain torch: the CPU path, the per-expert-loop oracle, and the block layout
the Triton kernel (``triton_moe.py``) runs over.

Called through ``dispatch.fused_moe`` by ``engine.models.moe.MoE`` (``grouped_moe`` on CPU), by the Triton launcher
(``align_block_size``) and by tests and ``devbench/moe_bench.py`` (``loop_moe``, the oracle). Every function takes
the layer's stacked weights and the router's choice:

    x        [T, H]        the layer's input rows
    w13      [E, 2I, H]    each expert's gate (rows [0, I)) and up (rows [I, 2I)) projections, this rank's I
    w2       [E, H, I]     each expert's down projection
    weights  [T, k]        float32 routing weights
    ids      [T, k]        int64 expert of each (token, slot)
    -> [T, H]              sum over the k slots of weight * down(silu(gate(x)) * up(x)), in x's dtype

``grouped_moe``: the T*k (token, slot) rows sorted by expert (a stable sort: a segment keeps token order), one
matmul per expert segment over contiguous rows via ``torch.nn.functional.grouped_mm`` (a loop in C++; no host
sync, no Python per expert), weighted in float32 and added into each token's row in expert order (``index_add_``:
the loop's order of adds, so the two give the same bits). Widths that grouped_mm does not take (a row not a
multiple of 16 bytes) run each nonempty segment through ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ops


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [T, k] -> (order [T*k]: flat (token, slot) rows by expert, token order within one; ends [E] int32:
    where each expert's segment of ``order`` ends)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    ends = expert_counts(flat, num_experts).cumsum(0).to(torch.int32)
    return order, ends


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """flat: [N] expert ids -> [E] int64 rows per expert. (Not ``torch.bincount``: on CUDA it reads the ids' max
    back to the host, a sync that a CUDA graph cannot capture.)"""
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """The grouped matmul by expert (module docstring)."""
    T, k = ids.shape
    order, ends = sort_by_expert(ids, w13.shape[0])
    token = order // k
    xs = x.index_select(0, token)                                            # [T*k, H], by expert
    h = _segments_mm(xs, w13, ends)                                          # [T*k, 2I]
    y = _segments_mm(silu_and_mul(h), w2, ends)                              # [T*k, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.flatten()[order, None])    # by expert, as the loop adds
    return out.to(x.dtype)


def loop_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor) -> torch.Tensor:
    """The oracle: one expert at a time over the tokens that chose it (HF transformers' loop)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            y = F.linear(silu_and_mul(F.linear(x[token], w13[e])), w2[e])
            out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    # h: [N, 2I] -> silu(gate) * up: [N, I]; float32 on CPU: one C pass (kernels/cpu_ops.c), as the dense MLP
    if h.dtype == torch.float32 and h.device.type == "cpu" and not torch.compiler.is_compiling():
        y = cpu_ops.silu_and_mul(h)
        if y is not None:
            return y
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """The Triton kernel's layout: each expert's (token, slot) rows padded to a multiple of ``block_m``.

    ids: [T, k] -> (rows [R]: flat (token * k + slot) row ids by expert, ``T * k`` in the padding; block_expert
    [R / block_m]: each block's expert, -1 for blocks past the last row; num_rows [1]: R actually used), with
    R = T*k + E*(block_m - 1) rounded up to ``block_m`` (the most padding can take: shapes known on the host
    without a sync). Pure tensor ops on ``ids``'s device."""
    n = ids.numel()
    flat = ids.flatten()
    counts = expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[flat[order]]  # place within its expert
    capacity = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((capacity,), n, dtype=torch.int32, device=ids.device)
    rows[(pad_ends - padded)[flat[order]] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(pad_ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert, pad_ends[-1:].to(torch.int32)


def _segments_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a: [N, K] rows by expert, w: [E, M, K], ends: [E] -> [N, M]: segment e times w[e]^T."""
    if _grouped_mm_takes(a, w):
        return F.grouped_mm(a, w.transpose(1, 2), offs=ends)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):             # widths grouped_mm refuses: nonempty segments only
        if end > start:
            # a copy: a slice starting mid-buffer is unaligned, and BLAS may then sum in another order than on the
            # loop's fresh x[token] -- other bits (it did on an AMD EPYC host, test_moe_layer)
            out[start:end] = F.linear(a[start:end].clone(), w[e])
        start = end
    return out


def _grouped_mm_takes(a: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped_mm needs every row of both operands to start on a 16-byte boundary."""
    size = a.element_size()
    return (a.shape[1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0 and a.shape[0] > 0

