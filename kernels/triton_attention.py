"""Triton paged attention over a packed ragged batch: decode rows and prefill/extend chunks in one kernel.

Called once per attention layer per step (the CUDA twin of ``reference.paged_attention``):

    paged_attention(q, k, v, cache, meta, scale)
      1. triton_cache.write_to_cache: the step's K/V rows -> cache at meta.slot_mapping
      2. unified_attention: every query row attends to its sequence's cache through meta.block_table
      3. (split-K only) _reduce_kernel: combine the segments' (max, sum, acc) into out

Layouts: q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]. Sequence b owns query
rows [qsl[b], qsl[b+1]) at positions seq_len - q_len .. seq_len - 1; query position qp sees key kp
iff kp <= qp and (no window or kp > qp - window).

Grid of the attention kernel: (query blocks, Hkv, num_splits).
  * A query block is BLOCK_Q query tokens of one sequence x the QPK = H / Hkv query heads that share
    one KV head: BLOCK_M = BLOCK_Q * QPK rows (GQA inside the kernel: each K/V tile is read once for
    all of them). Sequence b's blocks are numbered from qsl[b] // BLOCK_Q + b, so T // BLOCK_Q + B
    programs always cover every sequence; a program finds its sequence by binary search over qsl
    and exits when its block lies past the sequence's queries.
  * The program's visible keys [lo, hi) are cut into BLOCK_N tiles; split s of num_splits takes an
    equal run of tiles. K tiles are gathered through the block table one key at a time, so any
    block size works. Online softmax in fp32; a split with no tiles writes (-inf, 0, 0).
With num_splits == 1 the kernel normalises and stores out itself; otherwise it stores the
unnormalised partials [num_splits, T, H, (D)] and ``_reduce_kernel`` (one program per token and block of
heads) merges them.
Lengths are read on the device only; the grid comes from host ints (T, B, max_query_len, max_seq_len).
The split count is ``meta.num_splits`` where the runner fixed it (decode steps: the same for a CUDA graph and
an eager step, ``split_k.py``), else planned from the step's T, B and max_seq_len.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_plan import (INTERPRETED, AttentionPlan, pad_dim, plan_attention,  # noqa: F401
                                            reduce_heads)
from pdserve.kernels.split_k import MAX_SPLITS, MIN_SPLIT_KEYS, TARGET_PROGRAMS, splits_for  # noqa: F401
from pdserve.kernels.triton_cache import write_to_cache

LOG2E = 1.4426950408889634   # scores are kept in log2 units: exp2 is the fast path
# Arguments that change from step to step (or from model to model, for the head group) and whose value or alignment
# would only buy a Triton specialisation (== 1, divisible by 16, a 16-byte aligned view of the step's staging
# buffer): not specialised, so one compiled kernel serves every step of a variant and the start-up warm-up
# (``engine/runner/kernel_warmup.py``) compiles all a request can need.
STEP_INTS = ["num_seqs", "num_tokens", "num_splits", "bt_b", "H", "QPK", "BLOCK_Q"]
STEP_POINTERS = ["qsl_ptr", "seq_lens_ptr", "bt_ptr"]


@triton.jit
def _find_seq(qsl_ptr, block_idx, num_seqs, BLOCK_Q):
    """Largest b with qsl[b] // BLOCK_Q + b <= block_idx (sequence b's first query block)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mma(a, b, F32_DOT: tl.constexpr):
    """a [M, K] @ b [K, N] -> fp32. F32_DOT "": operands in b's dtype (bf16/fp16 tensor cores); else fp32
    operands at that input precision ("tf32x3" ~ fp32 accuracy on tensor cores; "ieee" in the interpreter,
    whose bf16 dot is wrong)."""
    if F32_DOT == "":
        c = tl.dot(a.to(b.dtype), b)
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    return c


@triton.jit
def _scores(q, q_rows, row_ok, k_rows, k_ok, D: tl.constexpr, D_PAD: tl.constexpr, F32_DOT: tl.constexpr,
            Q_CHUNK: tl.constexpr):
    """q @ K^T of one tile -> [BLOCK_M, BLOCK_N] fp32; k_rows [BLOCK_N]: pointers to the tile's keys.
    Q_CHUNK == D_PAD: one dot with q held in registers across the key loop. Smaller: D_PAD // Q_CHUNK dots, each
    reading its chunk of q again (from L1) -- fp32 q at a wide head dim, split in two for tf32x3 and replicated
    in every warp of a 16-row block, does not fit in registers (``attention_plan.tiles``)."""
    if Q_CHUNK == D_PAD:
        d = tl.arange(0, D_PAD)
        kt = tl.load(k_rows[None, :] + d[:, None], mask=k_ok[None, :] & (d < D)[:, None], other=0.0)
        s = _mma(q, kt, F32_DOT)
    else:
        s = tl.zeros([q_rows.shape[0], k_rows.shape[0]], tl.float32)
        for c in tl.static_range(D_PAD // Q_CHUNK):
            d = c * Q_CHUNK + tl.arange(0, Q_CHUNK)
            qc = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
            kt = tl.load(k_rows[None, :] + d[:, None], mask=k_ok[None, :] & (d < D)[:, None], other=0.0)
            s += _mma(qc, kt, F32_DOT)
    return s


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_POINTERS)
def _attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc, part_m, part_l,
                 qsl_ptr, seq_lens_ptr, bt_ptr, num_seqs, num_tokens, num_splits, qk_scale,
                 q_t, q_h, o_t, o_h, bt_b, c_blk, c_off, c_h,      # strides; head dim is unit-stride
                 H, QPK, BLOCK_Q, D: tl.constexpr, D_PAD: tl.constexpr,
                 BS: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, Q_CHUNK: tl.constexpr):
    blk, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = _find_seq(qsl_ptr, blk, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    first = (blk - (q_start // BLOCK_Q + b)) * BLOCK_Q          # first query row of this block, in b
    if first >= q_len:
        return
    pos0 = tl.load(seq_lens_ptr + b) - q_len                     # position of b's query row 0

    rows = tl.arange(0, BLOCK_M)                                 # row = token * QPK + head-in-group
    q_tok = first + rows // QPK                                  # [BLOCK_M] query row within b
    head = kvh * QPK + rows % QPK
    row_ok = (rows // QPK < BLOCK_Q) & (q_tok < q_len)
    t_row = (q_start + q_tok).to(tl.int64)                       # [BLOCK_M] flat token row
    d = tl.arange(0, D_PAD)
    q_rows = q_ptr + t_row * q_t + head * q_h                    # [BLOCK_M] pointers to the rows' q
    q = 0.0                                                      # Q_CHUNK < D_PAD: read per tile (_scores)
    if Q_CHUNK == D_PAD:
        q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)

    # keys visible to some row of the block: [lo, hi); this split's tiles of BLOCK_N keys: [t0, t1)
    hi = pos0 + tl.minimum(q_len, first + BLOCK_Q)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(0, pos0 + first - WINDOW + 1)
    per_split = tl.cdiv(tl.cdiv(hi, BLOCK_N) - lo // BLOCK_N, num_splits)
    t0 = lo // BLOCK_N + split * per_split
    t1 = tl.minimum(t0 + per_split, tl.cdiv(hi, BLOCK_N))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for tile in range(t0, t1):
        m_i, l_i, acc = _attend_tile(q, q_rows, m_i, l_i, acc, tile * BLOCK_N + tl.arange(0, BLOCK_N), lo, hi,
                                     pos0 + q_tok, row_ok, kc_ptr, vc_ptr, bt_ptr + b * bt_b, kvh * c_h,
                                     c_blk, c_off, qk_scale, D, D_PAD, BS, WINDOW, F32_DOT, Q_CHUNK)
    if SPLIT:
        row = (split * num_tokens + t_row) * H + head            # partials: [num_splits, T, H, (D_PAD)]
        tl.store(part_m + row, m_i, mask=row_ok)
        tl.store(part_l + row, l_i, mask=row_ok)
        tl.store(part_acc + row[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t_row[:, None] * o_t + head[:, None] * o_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _attend_tile(q, q_rows, m_i, l_i, acc, kp, lo, hi, q_pos, row_ok, kc_ptr, vc_ptr, table_ptr, head_off,
                 c_blk, c_off, qk_scale, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                 WINDOW: tl.constexpr, F32_DOT: tl.constexpr, Q_CHUNK: tl.constexpr):
    """One online-softmax step over the keys at positions kp [BLOCK_N] -> updated (m_i, l_i, acc)."""
    d = tl.arange(0, D_PAD)
    k_ok = (kp >= lo) & (kp < hi)
    page = tl.load(table_ptr + kp // BS, mask=k_ok, other=0).to(tl.int64)
    kv_off = page * c_blk + (kp % BS) * c_off + head_off                      # [BLOCK_N]
    s = _scores(q, q_rows, row_ok, kc_ptr + kv_off, k_ok, D, D_PAD, F32_DOT, Q_CHUNK) * qk_scale  # log2 units
    seen = row_ok[:, None] & k_ok[None, :] & (kp[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        seen = seen & (kp[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                    # rows that have seen nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None] & (d < D)[None, :], other=0.0)
    acc = acc * alpha[:, None] + _mma(p, v, F32_DOT)                         # [BLOCK_M, D_PAD]
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=["num_tokens", "num_splits", "H"])
def _reduce_kernel(part_acc, part_m, part_l, out_ptr, num_tokens, num_splits, o_t, o_h, H,
                   H_BLOCK: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """One program per (token, H_BLOCK heads): merge the splits' (max, sum, acc) of those heads into out [T, H, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, D_PAD)
    h_ok = h < H
    m_run = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_run = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, D_PAD], tl.float32)
    for s in range(num_splits):
        row = (s * num_tokens + t) * H + h                        # [H_BLOCK]
        m_s = tl.load(part_m + row, mask=h_ok, other=float("-inf"))
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_run, a_s = tl.exp2(m_run - m_safe), tl.exp2(m_s - m_safe)
        l_run = l_run * a_run + tl.load(part_l + row, mask=h_ok, other=0.0) * a_s
        acc_s = tl.load(part_acc + row[:, None] * D_PAD + d[None, :], mask=h_ok[:, None], other=0.0)
        acc = acc * a_run[:, None] + acc_s * a_s[:, None]
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + t * o_t + h[:, None] * o_h + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d < D)[None, :])


def paged_attention(q, k, v, cache: dict, meta, scale: float, sliding_window: int | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; writes k, v into the cache, returns out [T, H, D]."""
    write_to_cache(k, v, cache, meta.slot_mapping)
    out = torch.empty_like(q)
    return unified_attention(q, cache["k"], cache["v"], out, meta, scale, sliding_window, num_splits)


def unified_attention(q, k_cache, v_cache, out, meta, scale: float, sliding_window: int | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """Attend only: q [T, H, D] over the caches [num_blocks, block_size, Hkv, D] -> out [T, H, D].

    Rows past query_start_loc[B] (none under the metadata contract) are left unwritten.
    """
    _check(q, k_cache, v_cache, out, sliding_window)
    (T, H, D), Hkv, B = q.shape, k_cache.shape[2], meta.seq_lens.shape[0]
    if T == 0:
        return out
    fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    num_splits = meta.num_splits if num_splits is None else num_splits
    plan = plan_attention(T, B, H, Hkv, D, meta.max_query_len, meta.max_seq_len, fp32, num_splits)
    parts = _partials(plan.num_splits, T, H, pad_dim(D), q.device) if plan.num_splits > 1 else None
    for kernel, grid, args, kwargs in launches(q, k_cache, v_cache, out, parts, meta, plan, scale, sliding_window):
        kernel[grid](*args, **kwargs)
    return out


def launches(q, k_cache, v_cache, out, parts, meta, plan: AttentionPlan, scale: float, sliding_window: int | None):
    """[(kernel, grid, args, kwargs)] of one attention call: the attention kernel, then (split-K) the reduce.
    ``unified_attention`` launches them; ``offline_compile.py`` compiles the same for sm_90 from CPU tensors."""
    (T, H, D), Hkv, B = q.shape, k_cache.shape[2], meta.seq_lens.shape[0]
    d_pad, split = pad_dim(D), plan.num_splits > 1
    parts = parts if split else (out, out, out)
    attn = (_attn_kernel, (plan.num_q_blocks(T, B), Hkv, plan.num_splits),
            (q, k_cache, v_cache, out, *parts, meta.query_start_loc, meta.seq_lens, meta.block_table,
             B, T, plan.num_splits, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
             meta.block_table.stride(0), *k_cache.stride()[:3], H, H // Hkv, plan.block_q),
            dict(D=D, D_PAD=d_pad, BS=k_cache.shape[1], WINDOW=sliding_window or 0, BLOCK_M=plan.block_m,
                 BLOCK_N=plan.block_n, SPLIT=split, F32_DOT=plan.f32_dot, Q_CHUNK=plan.q_chunk,
                 num_warps=plan.num_warps,
                 num_stages=plan.num_stages))
    if not split:
        return [attn]
    h_block = reduce_heads(H, d_pad)
    reduce = (_reduce_kernel, (T, triton.cdiv(H, h_block)),
              (*parts, out, T, plan.num_splits, out.stride(0), out.stride(1), H),
              dict(H_BLOCK=h_block, D=D, D_PAD=d_pad, num_warps=4))
    return [attn, reduce]


def _partials(num_splits: int, T: int, H: int, d_pad: int, device) -> tuple[torch.Tensor, ...]:
    """Unnormalised split results: acc [S, T, H, D_PAD], max and sum [S, T, H], all fp32."""
    acc = torch.empty(num_splits, T, H, d_pad, dtype=torch.float32, device=device)
    m, l = (torch.empty(num_splits, T, H, dtype=torch.float32, device=device) for _ in range(2))
    return acc, m, l


def _check(q, k_cache, v_cache, out, sliding_window) -> None:
    T, H, D = q.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k cache {tuple(k_cache.shape)} and v cache {tuple(v_cache.shape)} must share a layout")
    if k_cache.shape[3] != D or H % k_cache.shape[2]:
        raise ValueError(f"q has {H} heads of dim {D}; the cache has {k_cache.shape[2]} KV heads of dim "
                         f"{k_cache.shape[3]} (need equal dims and H a multiple of Hkv)")
    if out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, q has {tuple(q.shape)}")
    if (q.stride(2), out.stride(2), k_cache.stride(3)) != (1, 1, 1):
        raise ValueError("q, out and the caches need a unit-stride head dim")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
