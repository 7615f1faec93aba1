"""DeepSeek's multi-head latent attention (MLA) over the latent KV cache: ``MLAAttention``.

Called by ``deepseek.DeepseekDecoderLayer`` once per layer and step:

    out = attn(x, cos, sin, kv_cache, attn_meta)      # x: [T, D] normed -> [T, H * v_head_dim], before o_proj

Per step (``MLAConfig`` names the dims; L = kv_lora_rank, R = qk_rope_head_dim, W = L + R):

    q         = q_proj(x) | q_b_proj(rms(q_a_proj(x)))     [T, H, nope + R] -> q_nope, q_pe (rotated)
    c, k_pe   = kv_a_proj(x)                               [T, L], [T, R]   c normed, k_pe rotated
    latent    = [c | k_pe]                                 [T, W]  -> the cache at slot_mapping (every row)
    decode rows (q_len 1): weight-absorbed, attention in the latent space (kernels' ``mla_decode``)
        q_lat = q_nope @ W_UK[h]            [B, H, L]     W_UK: kv_b_proj's key rows, [H, nope, L]
        o_lat = MQA([q_lat | q_pe], cache)  [B, H, L]     values = the latent part of the cached rows
        out   = o_lat @ W_UV[h]             [B, H, v]     W_UV: kv_b_proj's value rows, [H, L, v]
    short chunks over a cached prefix (``absorb_below`` rows: e.g. the tail a decode node recomputes after a store
    load): absorbed too, per sequence (its context gathered once, causal mask; ``absorbed_chunk``)
    other prefill / extend chunks: the plain path, per sequence
        ctx   = the sequence's cached latent rows, prefix + this chunk    [S, W]
        k, v  = kv_b_proj(ctx[:, :L]) per head, k = [k_nope | ctx[:, L:]]  [S, H, nope + R], [S, H, v]
        out   = causal attention of q = [q_nope | q_pe] (row i at position S - Q + i) over k, v

Both paths compute the same attention (``tests/test_mla.py`` checks absorbed == plain); absorbed decode reads
W values per cached token instead of decompressing H * (nope + v). The step's plan (which rows decode, each
prefill's table) is made once per step from the metadata's host mirrors and kept in ``attn_meta.derived``; a
decode-only step (every CUDA-graph step) uses the metadata as it is, with no host work.
Tensor parallel: q_b_proj / q_proj, kv_b_proj split by heads (column), o_proj by rows; q_a_proj and kv_a_proj are
replicated, so every rank computes and caches the same latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.layers import Linear, RMSNorm
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.rope import apply_rotary, apply_rotary_interleaved
from pdserve.kernels import dispatch
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.mla_reference import gather_latent
from pdserve.kernels.reference import _math_sdpa

LATENT_NORM_EPS = 1e-6       # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not the config's


@dataclass
class _Prefill:
    rows: slice                  # the sequence's query rows in the step
    q_len: int
    seq_len: int
    table: torch.Tensor          # [>= ceil(seq_len / bs)] block ids
    absorbed: bool = False       # a short chunk over a cached prefix: attention in the latent space


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None     # flat rows of the decode sequences; None: every row (decode-only step)
    decode_meta: AttentionMetadata | None
    prefills: list[_Prefill]


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, num_heads: int):
        super().__init__()
        m = config.mla
        self.mla, self.layer, self.num_heads = m, layer, num_heads
        d, dt, bias = config.hidden_size, config.dtype, config.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = Linear(d, num_heads * m.qk_head_dim, False, dt, "column")
            self.a_proj = Linear(d, m.latent_dim, bias, dt, "replicated")                   # kv_a_proj_with_mqa
        else:
            self.a_proj = Linear(d, (m.q_lora_rank, m.latent_dim), bias, dt, "replicated")  # q_a_proj | kv_a_proj
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dt)
            self.q_b_proj = Linear(m.q_lora_rank, num_heads * m.qk_head_dim, False, dt, "column")
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dt)
        self.kv_b_proj = Linear(m.kv_lora_rank, num_heads * (m.qk_nope_head_dim + m.v_head_dim), False, dt, "column")
        self.o_proj = Linear(num_heads * m.v_head_dim, d, bias, dt, "row")
        self.register_buffer("w_uk", torch.empty(num_heads, m.qk_nope_head_dim, m.kv_lora_rank, dtype=dt),
                             persistent=False)                                               # [H, nope, L]
        self.register_buffer("w_uv", torch.empty(num_heads, m.kv_lora_rank, m.v_head_dim, dtype=dt),
                             persistent=False)                                               # [H, L, v]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: dict,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, D]; cos, sin: [T, R] -> [T, H * v]; writes the step's latent rows into kv_cache
        q_nope, q_pe, latent = self.project(x, cos, sin)
        dispatch.write_latent(latent, kv_cache, attn_meta.slot_mapping, attn_meta.backend)
        return self.attend(q_nope, q_pe, latent, kv_cache, attn_meta).flatten(1)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [T, D] -> q_nope [T, H, nope], q_pe [T, H, R] (rotated), latent [T, W] = [rms(c) | rotated k_pe]
        m = self.mla
        if m.q_lora_rank is None:
            q, kv = self.q_proj(x), self.a_proj(x)
        else:
            q_a, kv = self.a_proj(x).split((m.q_lora_rank, m.latent_dim), dim=-1)
            q = self.q_b_proj(self.q_a_norm(q_a.contiguous()))
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split((m.qk_nope_head_dim, m.qk_rope_head_dim), dim=-1)
        c, k_pe = kv.split((m.kv_lora_rank, m.qk_rope_head_dim), dim=-1)
        rotate = apply_rotary_interleaved if m.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe.contiguous(), cos, sin), rotate(k_pe.unsqueeze(1).contiguous(), cos, sin)
        return q_nope, q_pe, torch.cat((self.kv_a_norm(c.contiguous()), k_pe[:, 0]), dim=-1)

    def attend(self, q_nope, q_pe, latent, kv_cache: dict, attn_meta: AttentionMetadata) -> torch.Tensor:
        # q_nope: [T, H, nope], q_pe: [T, H, R], latent: [T, W] (already in the cache) -> [T, H, v]
        plan = attn_meta.derived.get("mla")
        if plan is None:
            plan = attn_meta.derived["mla"] = _plan(attn_meta, self.mla)
        if plan.decode_rows is None:
            return self.absorbed(q_nope, q_pe, kv_cache, attn_meta)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.mla.v_head_dim)
        if plan.decode_rows.numel():
            r = plan.decode_rows
            out[r] = self.absorbed(q_nope[r], q_pe[r], kv_cache, plan.decode_meta)
        for p in plan.prefills:
            path = self.absorbed_chunk if p.absorbed else self.plain
            out[p.rows] = path(q_nope[p.rows], q_pe[p.rows], latent[p.rows], kv_cache, p)
        return out

    def absorbed(self, q_nope, q_pe, kv_cache: dict, meta: AttentionMetadata) -> torch.Tensor:
        # q_nope: [B, H, nope], q_pe: [B, H, R], one row per sequence of ``meta`` -> [B, H, v]
        m = self.mla
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)                 # [B, H, L]
        q = torch.cat((q_lat, q_pe), dim=-1)                                                 # [B, H, W]
        o_lat = dispatch.mla_decode(q, kv_cache, meta, m.softmax_scale, m.kv_lora_rank)      # [B, H, L]
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv).transpose(0, 1)                   # [B, H, v]

    def absorbed_chunk(self, q_nope, q_pe, new_latent, kv_cache: dict, p: _Prefill) -> torch.Tensor:
        # q_*: [Q, H, *] of one sequence over its [S, W] context, in the latent space -> [Q, H, v]
        m = self.mla
        ctx = gather_latent(kv_cache, p.table, p.seq_len).to(new_latent.dtype)              # [S, W]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)                                 # [H, Q, L]
        q = torch.cat((q_lat, q_pe.transpose(0, 1)), dim=-1)                                 # [H, Q, W]
        o_lat = causal_latent_attention(q, ctx, p.seq_len - p.q_len, m.softmax_scale, m.kv_lora_rank)
        return torch.bmm(o_lat, self.w_uv).transpose(0, 1)                                  # [Q, H, v]

    def plain(self, q_nope, q_pe, new_latent, kv_cache: dict, p: _Prefill) -> torch.Tensor:
        # q_*: [Q, H, *] of one sequence; its context is [S, W] (new rows last) -> [Q, H, v]
        m, H = self.mla, self.num_heads
        ctx = new_latent if p.seq_len == p.q_len else gather_latent(kv_cache, p.table, p.seq_len).to(new_latent.dtype)
        S = ctx.shape[0]
        kv = self.kv_b_proj(ctx[:, :m.kv_lora_rank].contiguous()).view(S, H, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split((m.qk_nope_head_dim, m.v_head_dim), dim=-1)
        k = torch.cat((k_nope, ctx[:, None, m.kv_lora_rank:].expand(S, H, m.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        mask = None                                           # causal from the top-left: no cached prefix
        if S != p.q_len:
            q_pos = torch.arange(S - p.q_len, S, device=q.device).unsqueeze(1)
            mask = torch.arange(S, device=q.device).unsqueeze(0) <= q_pos                   # [Q, S]
        q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
        if q.device.type == "cpu":                            # the unfused math path: a row's bits do not depend
            o = _math_sdpa(q, k, v, mask, m.softmax_scale)    # on the chunk's length (reference._heads_first)
        else:                                                 # fused SDPA: no [H, Q, S] score matrix in memory
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=m.softmax_scale)
        return o[0].transpose(0, 1)                                                          # [Q, H, v]

    def load(self, src, prefix: str, tp_rank: int) -> None:
        if self.mla.q_lora_rank is None:
            self.q_proj.load(src, f"{prefix}.q_proj", tp_rank)
            self.a_proj.load(src, f"{prefix}.kv_a_proj_with_mqa", tp_rank)
        else:
            self.a_proj.load(src, (f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"), tp_rank)
            self.q_a_norm.load(src, f"{prefix}.q_a_layernorm")
            self.q_b_proj.load(src, f"{prefix}.q_b_proj", tp_rank)
        self.kv_a_norm.load(src, f"{prefix}.kv_a_layernorm")
        self.kv_b_proj.load(src, f"{prefix}.kv_b_proj", tp_rank)
        self.o_proj.load(src, f"{prefix}.o_proj", tp_rank)
        self.absorb()

    @torch.no_grad()
    def absorb(self) -> None:
        """W_UK, W_UV from kv_b_proj's weight [H * (nope + v), L] (this rank's heads), for the absorbed path."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk.copy_(w[:, :m.qk_nope_head_dim])
        self.w_uv.copy_(w[:, m.qk_nope_head_dim:].transpose(1, 2))


def causal_latent_attention(q: torch.Tensor, ctx: torch.Tensor, offset: int, scale: float, L: int) -> torch.Tensor:
    """q: [H, Q, W] (absorbed), ctx: [S, W] one sequence's latent rows; query i at position offset + i sees keys
    0 .. offset + i -> [H, Q, L] (softmax in float32; values are the latent part of the keys)."""
    scores = torch.matmul(q, ctx.t()).float() * scale                                        # [H, Q, S]
    Q, S = q.shape[1], ctx.shape[0]
    future = torch.arange(S, device=q.device) > (offset + torch.arange(Q, device=q.device)).unsqueeze(1)
    probs = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, ctx[:, :L])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)                    # [T, H, D] -> [1, H, T, D]


def absorb_below(m) -> int:
    """Query rows below which a chunk over a cached prefix is cheaper absorbed than plain. Per head, for a chunk of
    Q rows over S cached tokens: plain decompresses S latents (S * L * (nope + v)) and attends Q * S * (qk + v);
    absorbed attends Q * S * (2L + R) in the latent space. Absorbed wins while Q * (2L + R - qk - v) < L * (nope + v):
    below ~170 rows for DeepSeek-V2/V3's dims (a decode node's recomputed tail after a store load, short chunks)."""
    extra = 2 * m.kv_lora_rank + m.qk_rope_head_dim - m.qk_head_dim - m.v_head_dim
    return m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) // max(1, extra)


def _plan(meta: AttentionMetadata, m) -> _Plan:
    """The step's decode rows (their metadata re-cut to one query each) and its prefill / extend sequences, each
    marked for the absorbed path when it is a short chunk over a cached prefix (``absorb_below``)."""
    if meta.is_decode_only:
        return _Plan(None, None, [])
    qsl, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    limit = absorb_below(m)
    decodes, prefills = [], []
    for b, s in enumerate(lens):
        start, n = qsl[b], qsl[b + 1] - qsl[b]
        if n == 1:
            decodes.append(start)
        elif n > 1:
            prefills.append(_Prefill(slice(start, start + n), n, s, meta.block_table[b], n < limit and s > n))
    rows = torch.tensor(decodes, dtype=torch.long)
    return _Plan(rows, meta.for_rows(rows) if decodes else None, prefills)
