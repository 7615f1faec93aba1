"""The Triton attention launch's tile sizes, warps, pipeline stages and split count: host ints in, no triton import.

Called by ``triton_attention.unified_attention`` for every launch (``plan_attention``), by ``kernel_variants.py`` to
list every plan a model can get (the start-up warm-up and the offline sm_90 compile check), and by tests.

    tiles(qpk, head_dim, max_query_len, fp32)   -> Tiles: what the kernel is compiled for (with the dtype and D)
    plan_attention(T, B, H, Hkv, D, max_query_len, max_seq_len, fp32, num_splits) -> AttentionPlan

The tiles depend on the dtype class (fp32 or 16-bit), the padded head dim and the query-length class only
(decode: one token x the head group; prefill: up to TILE_ROWS rows); the split count on the step's lengths
(``split_k.py``). Every choice here compiles on sm_90 without a register spill and within the shared memory of
a block: ``tests/test_kernel_compile.py`` checks each one with ptxas (table: ``devbench/compile_table.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.kernels.split_k import splits_for

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # Triton's own switch, as it was at import


def interpreted() -> bool:
    """Triton's switch as it is now: a plan is made per call, and this module may be imported (by the offline
    compile table, say) before a test sets TRITON_INTERPRET -- the kernels read it when their module loads."""
    return os.environ.get("TRITON_INTERPRET") == "1"
TILE_ROWS = 64 * 128     # BLOCK_M x D_PAD of a 16-bit program's fp32 accumulator (at 8 warps: 32 per thread)


@dataclass(frozen=True)
class Tiles:
    """What one compiled attention kernel is specialised for, besides the dtype, head dim and window."""
    block_m: int        # rows per program: block_q tokens x QPK heads (>= 16 for tl.dot)
    block_q: int
    block_n: int        # keys per tile
    num_warps: int
    num_stages: int     # software-pipelining depth of the key loop (each stage holds a K and a V tile in smem)
    f32_dot: str        # "" (bf16/fp16 operands) or the fp32 input precision, see triton_attention._mma
    q_chunk: int        # head-dim columns of q per QK^T dot: d_pad holds q in registers, less re-reads it per tile


@dataclass(frozen=True)
class AttentionPlan(Tiles):
    """Tiles plus the split count for one launch, chosen on the host from host ints only."""
    num_splits: int = 1

    def num_q_blocks(self, num_tokens: int, num_seqs: int) -> int:
        return num_tokens // self.block_q + num_seqs   # >= sum_b cdiv(q_len_b, block_q), see triton_attention


def pad_dim(head_dim: int) -> int:
    """The head dim the kernel's tiles use: a power of two >= 16 (tl.dot needs K >= 16; pad lanes are masked)."""
    return max(16, next_power_of_2(head_dim))


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tiles(qpk: int, head_dim: int, max_query_len: int, fp32: bool) -> Tiles:
    """Per thread, the fp32 accumulator (BLOCK_M x D_PAD) and the K/V tile in flight (BLOCK_N x D_PAD) stay
    within what ptxas keeps in registers. Decode (max_query_len 1): one token x the head group, padded to 16
    rows; prefill: up to TILE_ROWS / D_PAD rows (half that for fp32, whose tf32x3 dots need three products).

    fp32 at D_PAD >= 128 also splits q: each warp holds all of its 16 rows of q as a dot operand, in a high and
    a low tf32 part, which at D_PAD 128 (a 32-row block) or 256 left 255 registers and spilled; 8 warps and
    QK^T in chunks of Q_CHUNK = 1024 / BLOCK_M columns of q (re-read from L1 per key tile) keep it under 200."""
    d_pad = pad_dim(head_dim)
    m_cap = TILE_ROWS // d_pad // (2 if fp32 else 1)
    block_m = max(16, min(next_power_of_2(max_query_len * qpk), m_cap), next_power_of_2(qpk))
    num_warps, q_chunk = (8 if block_m * d_pad >= TILE_ROWS else 4), d_pad
    if fp32 and d_pad >= 128:
        num_warps, q_chunk = 8, min(d_pad, 1024 // block_m)
    block_n = max(16, min(1024 * num_warps // d_pad // (2 if fp32 else 1), 64))
    interp = interpreted()
    f32_dot = ("ieee" if interp else "tf32x3") if fp32 or interp else ""
    return Tiles(block_m, block_m // qpk, block_n, num_warps, 3, f32_dot, q_chunk)


def reduce_heads(num_heads: int, d_pad: int) -> int:
    """Heads per program of the split-K reduce (4 warps): its fp32 accumulator H_BLOCK x D_PAD holds at most 4096
    values, 32 per thread (all 64 heads of 256 in one program took 255 registers and spilled)."""
    return min(next_power_of_2(num_heads), max(1, 4096 // d_pad))


def plan_attention(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   max_query_len: int, max_seq_len: int, fp32: bool, num_splits: int | None = None) -> AttentionPlan:
    """The launch plan of one step: ``tiles`` and a split count (``num_splits`` when the runner fixed it:
    decode steps, ``decode_splits.py``; else from the step's programs and longest context)."""
    t = tiles(num_heads // num_kv_heads, head_dim, max_query_len, fp32)
    if num_splits is None:
        num_splits = splits_for((num_tokens // t.block_q + num_seqs) * num_kv_heads, max_seq_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return AttentionPlan(**vars(t), num_splits=num_splits)
