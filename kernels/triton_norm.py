"""Triton RMSNorm, optionally fused with the residual add before it (vLLM's ``fused_add_rms_norm``).

Called by ``fused_ops.rms_norm`` (itself called by ``engine.models.layers.RMSNorm``) on the CUDA path:

    y = rms_norm(x, weight, eps)                        x: [T, N] or [T, H, N] (q/k norm), any row strides
    y, s = rms_norm(x, weight, eps, residual)           x, residual: [T, N]; s = residual + x

The same arithmetic as the torch path (``fused_ops.rms_norm_ref``, HF's): ``s`` is rounded to the activations'
dtype, normalised in float32 (sum of squares / N + eps, reciprocal square root), cast back to that dtype,
then multiplied by the weight (``w * x``: no model here stores ``w - 1`` as Gemma does) and rounded once.
Only the float32 sum's order (and the rsqrt's last bit) can differ from torch's.

Grid: one program per ROWS rows; each loads [ROWS, BLOCK] of x (BLOCK = N rounded up to a power of two,
the tail masked), so a 2048-wide hidden row is one program and 128-wide q/k-norm rows go 16 to a program.
One pass: read x (and the residual), write y (and s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 65536     # wider rows go to the torch path (``fused_ops``)
TILE = 2048           # elements per program when rows are narrow


@triton.jit(do_not_specialize=["R"])      # rows vary per step: one compile serves 1, 16, 17... rows
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, R, H, N, eps,
                     x_t, x_h, r_t, s_t,                      # strides (the last dim is unit-stride)
                     HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)          # [ROWS] flat rows t * H + h
    cols = tl.arange(0, BLOCK)
    ok = (row < R)[:, None] & (cols < N)[None, :]
    t, h = (row // H).to(tl.int64), (row % H).to(tl.int64)
    x = tl.load(x_ptr + (t * x_t + h * x_h)[:, None] + cols[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:                                             # H == 1 here
        r = tl.load(r_ptr + (t * r_t)[:, None] + cols[None, :], mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + (t * s_t)[:, None] + cols[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)          # [ROWS]
    normed = (xf * rstd[:, None]).to(x.dtype)                    # cast back before the weight, like HF
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(y_ptr + row.to(tl.int64)[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """-> y (x's shape, contiguous), or (y, residual + x) with ``residual``. Neither input is written."""
    _check(x, weight, residual)
    n = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)                   # [T, H, N]
    T, H = x3.shape[0], x3.shape[1]
    act = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, act), device=x.device)
    s = torch.empty(x.shape, dtype=act, device=x.device) if residual is not None else y
    r = residual if residual is not None else x
    if T * H:
        kernel, grid, args, kwargs = launch(x3, r, weight, y, s, eps, residual is not None)
        kernel[grid](*args, **kwargs)
    return y if residual is None else (y, s)


def launch(x3: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, s: torch.Tensor, eps: float,
           has_residual: bool):
    """(kernel, grid, args, kwargs) of one norm over x3 [T, H, N]: ``rms_norm`` runs it, ``offline_compile.py``
    builds it for sm_90 (one compile for every row count: ``R`` is not specialised)."""
    T, H, n = x3.shape
    block = triton.next_power_of_2(n)
    rows = max(1, min(16, TILE // block))
    return (_rms_norm_kernel, (triton.cdiv(T * H, rows),),
            (x3, r, weight, y, s, T * H, H, n, eps, x3.stride(0), x3.stride(1), r.stride(0), s.stride(0)),
            dict(HAS_RESIDUAL=has_residual, ROWS=rows, BLOCK=block, num_warps=_warps(rows * block)))


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 256))


def _check(x, weight, residual) -> None:
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, N] or [T, H, N] with a unit-stride last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous [{x.shape[-1]}]")
    if triton.next_power_of_2(x.shape[-1]) > MAX_BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} exceed the kernel's {MAX_BLOCK}")
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match a 2-D x {tuple(x.shape)}, unit-stride rows")
