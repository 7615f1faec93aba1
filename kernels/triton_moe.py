"""Triton fused MoE: the routed experts as two grouped GEMMs over expert-sorted row blocks (the CUDA twin of
``moe_ops.grouped_moe``; the torch oracle is ``moe_ops.loop_moe``).

Called by ``dispatch.fused_moe`` for CUDA tensors (and by tests under ``TRITON_INTERPRET=1``), once per MoE layer
per step. Shapes are ``moe_ops``'s (x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights / ids [T, k]). Steps:

    rows, block_expert, num_rows = moe_ops.align_block_size(ids, E, BLOCK_M)   # each expert's rows padded to BLOCK_M
    h   [T*k, 2I] = GEMM(x[row // k], w13[block's expert])                      # launch 1
    a   [T*k, I]  = silu(h[:, :I]) * h[:, I:]                                    # torch
    y   [T*k, H]  = weight[row] * GEMM(a[row], w2[block's expert])  (float32)    # launch 2
    out [T, H]    = y.view(T, k, H).sum(1)                                        # torch

Grid of each GEMM: one program per (BLOCK_M rows of ``rows``, BLOCK_N output columns); a block holds one expert's
rows only (the padding is row id T*k, masked), so a program reads one expert's [BLOCK_N, K] weight panel. The
grid is sized for the most padding ids can need (``align_block_size``'s capacity), and programs past
``num_rows`` (read on the device) return at once: no host sync. Tiles: ``moe_tiles`` (BLOCK_M from the mean rows
per expert, K/N tiles by dtype); the variants are listed for the offline sm_90 compile
(``offline_compile.moe_jobs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.kernel_variants import MOE_BLOCK_MS as BLOCK_MS
from pdserve.kernels.moe_ops import align_block_size, silu_and_mul

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    f32_dot: str             # "" (operands in the weights' half dtype), "tf32x3" (fp32 on tensor cores), "ieee"


def moe_tiles(num_rows: int, num_experts: int, dtype: torch.dtype, interpreted: bool = INTERPRETED) -> MoETiles:
    """Tiles for ``num_rows`` (T*k) rows over ``num_experts``: the smallest BLOCK_M that holds the mean segment."""
    mean = num_rows / max(num_experts, 1)
    block_m = next((m for m in BLOCK_MS if mean <= m), BLOCK_MS[-1])
    fp32 = dtype == torch.float32
    f32_dot = ("ieee" if interpreted else "tf32x3") if fp32 or interpreted else ""
    return MoETiles(block_m, 64, 32 if fp32 else 64, 4, 2 if fp32 else 3, f32_dot)


@triton.jit(do_not_specialize=["num_valid", "top_k"])
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, rows_ptr, block_expert_ptr, num_rows_ptr,
                     num_valid, top_k, N, K,
                     a_m, a_k, b_e, b_n, b_k, c_m, c_n,
                     MUL_WEIGHT: tl.constexpr, F32_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))          # [BLOCK_M] flat (token, slot)
    valid = rows < num_valid
    a_rows = (rows // top_k).to(tl.int64)                                        # A's row: the token (launch 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * b_e + cols[None, :] * b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * a_m + kk[None, :] * a_k, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + kk[:, None] * b_k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if F32_DOT == "":
            acc += tl.dot(a.to(b.dtype), b)
        else:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + rows, mask=valid, other=0.0)[:, None]
    c = c_ptr + rows.to(tl.int64)[:, None] * c_m + cols[None, :] * c_n
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """The routed experts (module docstring): -> [T, H] in x's dtype."""
    T, k = ids.shape
    if T == 0:
        return x.new_zeros(x.shape)
    tiles = moe_tiles(T * k, w13.shape[0], x.dtype)
    layout = align_block_size(ids, w13.shape[0], tiles.block_m)
    h = x.new_empty(T * k, w13.shape[1])
    _run(launch(x, w13, h, None, layout, k, tiles))
    a = silu_and_mul(h)
    y = torch.empty(T * k, w2.shape[1], dtype=torch.float32, device=x.device)
    _run(launch(a, w2, y, weights.flatten().float(), layout, 1, tiles))
    return y.view(T, k, -1).sum(dim=1).to(x.dtype)


def launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, w: torch.Tensor | None, layout, top_k: int,
           tiles: MoETiles):
    """(kernel, grid, args, kwargs) of one grouped GEMM c[row] = (w[row] *) a[row // top_k] @ b[expert]^T:
    ``fused_moe`` launches it, ``offline_compile.moe_jobs`` compiles it."""
    rows, block_expert, num_rows = layout
    n, kdim = b.shape[1], b.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, tiles.block_n))
    args = (a, b, c, rows if w is None else w, rows, block_expert, num_rows, c.shape[0], top_k, n, kdim,
            *a.stride(), *b.stride(), *c.stride())
    return _moe_gemm_kernel, grid, args, dict(
        MUL_WEIGHT=w is not None, F32_DOT=tiles.f32_dot, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _run(job) -> None:
    kernel, grid, args, kwargs = job
    kernel[grid](*args, **kwargs)
