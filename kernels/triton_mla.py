"""Triton weight-absorbed MLA decode over the paged latent cache (the CUDA twin of ``mla_reference.mla_decode``).

Called through ``dispatch`` by the MLA attention (``engine/models/mla.py``):

    write_latent(latent, cache, slots)    every row of the step: [T, W] -> the cache (one program per row; slot < 0
                                          is CUDA-graph padding, skipped)
    mla_decode(q, cache, meta, scale, L)  the step's decode rows
      1. _mla_kernel: each program attends BLOCK_H heads of one sequence to one split of its keys
      2. (split-K only) _mla_reduce_kernel: merge the splits' (max, sum, acc) into out

Layouts: q [B, H, W] (absorbed q_nope [L] then q_pe [R], W = L + R), one query row per sequence;
cache [num_blocks, block_size, 1, W]; out [B, H, L]. Sequence b reads positions 0 .. seq_lens[b] - 1 through
block_table[b]. It is multi-query attention: every head of the program scores against the same key tile, so a
latent tile [BLOCK_N, L] is loaded once for BLOCK_H heads and used twice (scores, then values: the values are the
latent part of the keys). Scores are q_lat . lat + q_pe . pe, in log2 units (exp2); online softmax in fp32.

Grid of the attention kernel: (B, cdiv(H, BLOCK_H), num_splits). Split s of num_splits takes an equal run of the
sequence's BLOCK_N-key tiles; a split with no tiles stores (-inf, 0, 0). With one split the kernel normalises and
stores out itself; otherwise partials acc [S, B, H, BLOCK_L], max and sum [S, B, H] (fp32) go to the reduce (one
program per sequence and block of heads). Lengths are read on the device only; the grid uses host ints.
Tiles: BLOCK_H = 16 heads (tl.dot's smallest M), BLOCK_N = 16 keys; 4 warps (fp32: 8, ``num_warps``). At
DeepSeek's L = 512 the fp32 accumulator is 16 x 512 (64 registers a thread at 4 warps) beside one latent tile;
``tests/test_kernel_compile.py`` checks that ptxas keeps it without a spill for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_plan import interpreted
from pdserve.kernels.split_k import splits_for
from pdserve.kernels.triton_attention import LOG2E, _mma

BLOCK_H, BLOCK_N, NUM_STAGES = 16, 16, 2


def num_warps(fp32: bool) -> int:
    """4 warps for 16-bit latents (bf16/fp16 tensor-core dots); fp32 latents run exact fp32 FMA dots ("ieee") over 8
    warps. At L = 512 on sm_90: ~110 registers and no spill; tf32x3 dots (each operand split in two) spilled
    ~2.5 KB at 4 or 8 warps (``devbench/compile_table.py``)."""
    return 8 if fp32 else 4


@triton.jit
def _write_kernel(x_ptr, cache_ptr, slots_ptr, x_t, c_tok, W: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_W)
    ok = offs < tl.where(slot >= 0, W, 0)                   # a padding slot (-1) writes nothing
    x = tl.load(x_ptr + t.to(tl.int64) * x_t + offs, mask=ok, other=0.0)
    tl.store(cache_ptr + slot * c_tok + offs, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mla_kernel(q_ptr, cache_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, seq_lens_ptr, bt_ptr,
                num_seqs, num_splits, qk_scale, H, q_b, q_h, o_b, o_h, bt_b, c_blk, c_tok,
                L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < H
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    l_ok, r_ok = offs_l < L, offs_r < R
    q_row = q_ptr + b.to(tl.int64) * q_b + heads[:, None] * q_h
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)      # [BH, BL]
    q_pe = tl.load(q_row + L + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)   # [BH, BR]
    seq_len = tl.load(seq_lens_ptr + b)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, tiles)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for t in range(first, last):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_b + n // BS, mask=n_ok, other=0)
        row = cache_ptr + blk.to(tl.int64) * c_blk + (n % BS) * c_tok                               # [BN]
        lat = tl.load(row[:, None] + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :], other=0.0)  # [BN, BL]
        pe = tl.load(row[:, None] + L + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        s = _mma(q_lat, tl.trans(lat), F32_DOT) + _mma(q_pe, tl.trans(pe), F32_DOT)                # [BH, BN]
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mma(p, lat, F32_DOT)
        m = m_new
    if SPLIT:
        part = (split * num_seqs + b).to(tl.int64) * H + heads                                       # [BH]
        tl.store(acc_ptr + part[:, None] * BLOCK_L + offs_l[None, :], acc, mask=h_ok[:, None])
        tl.store(m_ptr + part, m, mask=h_ok)
        tl.store(l_ptr + part, s_sum, mask=h_ok)
    else:
        out = acc / s_sum[:, None]
        o_row = out_ptr + b.to(tl.int64) * o_b + heads[:, None] * o_h
        tl.store(o_row + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])


@triton.jit
def _mla_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, num_seqs, num_splits, H, o_b, o_h,
                       L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_l = tl.arange(0, BLOCK_L)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for s in range(0, num_splits):
        part = (s * num_seqs + b).to(tl.int64) * H + heads
        ms = tl.load(m_ptr + part, mask=h_ok, other=float("-inf"))
        ls = tl.load(l_ptr + part, mask=h_ok, other=0.0)
        accs = tl.load(acc_ptr + part[:, None] * BLOCK_L + offs_l[None, :], mask=h_ok[:, None], other=0.0)
        m_new = tl.maximum(m, ms)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # no split seen keys yet: weights 0, not nan
        a, c = tl.exp2(m - safe), tl.exp2(ms - safe)
        s_sum = s_sum * a + ls * c
        acc = acc * a[:, None] + accs * c[:, None]
        m = m_new
    out = acc / tl.where(h_ok, s_sum, 1.0)[:, None]          # padding heads: no 0 / 0
    o_row = out_ptr + b.to(tl.int64) * o_b + heads[:, None] * o_h
    tl.store(o_row + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (offs_l < L)[None, :])


def write_latent(latent: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> None:
    """latent: [T, W] -> cache["latent"] [N, bs, 1, W] at flat slots (< 0 skipped)."""
    c = cache["latent"]
    if latent.shape[-1] != c.shape[-1] or slot_mapping.shape != (latent.shape[0],) or latent.stride(-1) != 1:
        raise ValueError(f"latent rows {tuple(latent.shape)} with slots {tuple(slot_mapping.shape)} do not fit a "
                         f"cache {tuple(c.shape)}")
    if latent.shape[0]:
        kernel, grid, args, kwargs = write_launch(latent, c, slot_mapping)
        kernel[grid](*args, **kwargs)


def write_launch(latent, c, slot_mapping):
    """(kernel, grid, args, kwargs) of one latent write (``offline_compile.py`` compiles the same)."""
    W = c.shape[-1]
    # c.stride(1): one token's row; a block is bs rows, so slot * stride(1) addresses (slot // bs, slot % bs)
    return (_write_kernel, (latent.shape[0],), (latent, c, slot_mapping, latent.stride(0), c.stride(1)),
            dict(W=W, BLOCK_W=triton.next_power_of_2(W), num_warps=4))


def mla_decode(q: torch.Tensor, cache: dict, meta, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """q: [B, H, W], one query row per sequence of ``meta`` -> [B, H, L] in q's dtype."""
    latent = cache["latent"]
    _check(q, latent, kv_lora_rank)
    B, H, _ = q.shape
    num_splits = meta.num_splits or splits_for(B * triton.cdiv(H, BLOCK_H), meta.max_seq_len)
    out = q.new_empty(B, H, kv_lora_rank)
    parts = _partials(num_splits, B, H, triton.next_power_of_2(kv_lora_rank), q.device) if num_splits > 1 else None
    for kernel, grid, args, kwargs in launches(q, latent, out, parts, meta, scale, kv_lora_rank, num_splits):
        kernel[grid](*args, **kwargs)
    return out


def launches(q, latent, out, parts, meta, scale: float, kv_lora_rank: int, num_splits: int) -> list:
    """[(kernel, grid, args, kwargs)] of one decode call: the attention kernel, then (split-K) the reduce.
    ``mla_decode`` launches them; ``offline_compile.py`` compiles the same for sm_90 from CPU tensors."""
    B, H, W = q.shape
    L, split = kv_lora_rank, num_splits > 1
    block_l, block_r = triton.next_power_of_2(L), max(16, triton.next_power_of_2(W - L))
    fp32 = torch.float32 in (q.dtype, latent.dtype)
    f32_dot = "ieee" if fp32 or interpreted() else ""       # the interpreter's bf16 dot is wrong: fp32 there too
    acc, m, l = parts if split else (out, out, out)
    attn = (_mla_kernel, (B, triton.cdiv(H, BLOCK_H), num_splits),
            (q, latent, out, acc, m, l, meta.seq_lens, meta.block_table, B, num_splits, scale * LOG2E, H,
             q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
             latent.stride(0), latent.stride(1)),
            dict(L=L, R=W - L, BLOCK_L=block_l, BLOCK_R=block_r, BS=latent.shape[1], BLOCK_H=BLOCK_H,
                 BLOCK_N=BLOCK_N, SPLIT=split, F32_DOT=f32_dot, num_warps=num_warps(fp32), num_stages=NUM_STAGES))
    if not split:
        return [attn]
    reduce = (_mla_reduce_kernel, (B, triton.cdiv(H, BLOCK_H)),
              (acc, m, l, out, B, num_splits, H, out.stride(0), out.stride(1)),
              dict(L=L, BLOCK_L=block_l, BLOCK_H=BLOCK_H, num_warps=4))
    return [attn, reduce]


def _partials(num_splits: int, B: int, H: int, block_l: int, device) -> tuple[torch.Tensor, ...]:
    """Unnormalised split results: acc [S, B, H, BLOCK_L], max and sum [S, B, H], all fp32."""
    acc = torch.empty(num_splits, B, H, block_l, dtype=torch.float32, device=device)
    m, l = (torch.empty(num_splits, B, H, dtype=torch.float32, device=device) for _ in range(2))
    return acc, m, l


def _check(q: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int) -> None:
    W = latent.shape[-1]
    if latent.dim() != 4 or latent.shape[2] != 1 or q.shape[-1] != W:
        raise ValueError(f"q {tuple(q.shape)} against a latent cache {tuple(latent.shape)}: need "
                         f"[num_blocks, block_size, 1, W] and q's last dim W")
    if not 0 < kv_lora_rank < W:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must lie in (0, {W}) for a latent of width {W}")
    if q.stride(2) != 1 or latent.stride(3) != 1:
        raise ValueError("q and the latent cache need a unit-stride last dim")
