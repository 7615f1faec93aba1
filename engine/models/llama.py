"""Llama-family decoder: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, and the MoE
members Qwen3MoeForCausalLM, MixtralForCausalLM and Qwen2MoeForCausalLM.

One implementation; the differences are ``ModelConfig`` flags (q/k/v bias, o_proj bias, MLP
bias, q/k norm, per-layer sliding window) and each layer's MLP (``moe.make_mlp``: dense, or the MoE block). Called by
the model runner once per step:

    hidden = model(input_ids, positions, kv_caches, attn_meta)   # [T, D], T = all new tokens
    logits = model.compute_logits(hidden[sample_rows])           # [N, V] float32

or, where only the sampled rows' hidden states are wanted (``logit_rows``, the single-process CPU runner):

    hidden = model(input_ids, positions, kv_caches, attn_meta, logit_rows=LogitRows(rows, attn_meta.for_rows(rows)))
    logits = model.compute_logits(hidden)                        # hidden: [N, D]

The last layer then runs its norm and K/V projection for every row (their K/V go into the cache), but the
query (``SplitQKV``), attention, o_proj and the MLP only for ``rows``: a prompt's other rows feed no logits,
and no later layer reads them. A 2048-token prefill step of a 4-layer model skips ~a quarter of its
attention and MLP work.
Each kept row's result has the bits it has in the full step only where no result depends on the other
rows: the ``cpu`` attention kernel (its rows do not depend on how a prompt is chunked) on a cache it takes,
the C RMSNorm, fp32 matmuls on oneDNN with the few-row kernel's panels, run eagerly
(``DecoderLayer.rows_independent``; the runner checks the rest and keeps the full step elsewhere: the torch
reference attention, F.linear and half precision round a row differently by the batch's size):
tests/test_logit_rows.py compares them.

Tokens of the whole batch are flattened (no padding); ``attn_meta`` (``pdserve.kernels``) says
which rows belong to which sequence and where their K/V go in the paged cache. ``kv_caches``
holds this model's layers only: ``kv_caches[i]`` belongs to global layer ``first_layer + i``.

A decoder layer is two pieces around attention, ``before_attention`` (norm, qkv, q/k norm, RoPE)
and ``after_attention`` (o_proj, residual, norm, MLP); ``pieces`` (``LayerPieces``) runs them as
they are, or ``torch.compile``d (``pdserve.engine.runner.compile``); attention always runs eagerly.
On CUDA (``kernels/fused_ops.py``'s switches) the eager layers run ``forward_fused`` instead: each residual
add goes into the next RMSNorm's Triton kernel (``RMSNorm.add_norm``: a layer hands its MLP output on
unadded, the next layer's input norm adds it), and RoPE rotates q and k in place in one kernel.

Parallelism stays outside: ``ShardSizes`` are this rank's heads / MLP width, and a pipeline
stage is a layer range. Only the first stage embeds tokens (later stages take ``hidden``
from the previous one); only the last applies the final norm and owns ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pdserve.engine.models.layers import Embedding, Linear, LMHead, RMSNorm
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.moe import make_mlp
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary, apply_rotary_qk
from pdserve.engine.models.split_qkv import SplitQKV
from pdserve.engine.models.vocab import padded_vocab
from pdserve.kernels import AttentionMetadata, fused_ops, paged_attention, write_to_cache


@dataclass(frozen=True)
class ShardSizes:
    """What one tensor-parallel rank holds; ``full(config)`` is the whole model."""
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int                  # rows of the embedding / LM head this rank holds (of the padded vocabulary)
    tp_size: int = 1                 # the MoE layers split each expert's width by it (``moe.MoE``)

    @classmethod
    def full(cls, config: ModelConfig) -> ShardSizes:
        return cls(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)

    @classmethod
    def for_tp(cls, config: ModelConfig, tp_size: int) -> ShardSizes:
        """One of ``tp_size`` equal shards: heads, KV heads and MLP width must divide; the vocabulary is padded
        (``vocab.padded_vocab``) where it does not."""
        sizes = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
                 "intermediate_size": config.intermediate_size, "vocab_size": padded_vocab(config.vocab_size, tp_size)}
        moe = {} if config.moe is None else {"moe_intermediate_size": config.moe.intermediate_size,
                                             "shared expert width": config.moe.shared_intermediate_size}
        for what, n in {**sizes, **moe}.items():
            if n % tp_size:
                raise ValueError(f"the model has {n} {what}, not divisible by --tensor-parallel-size {tp_size}")
        return cls(*(n // tp_size for n in sizes.values()), tp_size=tp_size)


class LayerPieces(NamedTuple):
    """A decoder layer's non-attention parts, ``f(layer, ...)``: this module's methods, or their
    ``torch.compile``d versions (``pdserve.engine.runner.compile``). Attention itself always runs eagerly."""
    before_attention: Callable        # (layer, h, cos, sin) -> q, k, v
    after_attention: Callable         # (layer, h, attn_out) -> h


class LogitRows(NamedTuple):
    """The rows whose hidden states feed logits, and the attention metadata that makes each its own query."""
    rows: torch.Tensor                # [S] int64, host: flat rows of the step, ascending
    attn: AttentionMetadata           # ``attn_meta.for_rows(rows)``


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.sliding_window_for(layer)
        d, dt = config.head_dim, config.dtype
        self.qkv = Linear(config.hidden_size, (num_heads * d, num_kv_heads * d, num_kv_heads * d),
                          config.attention_bias, dt, "column")
        self.o_proj = Linear(num_heads * d, config.hidden_size, config.o_proj_bias, dt, "row")
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dt) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dt) if config.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [T, D]; cos, sin: [T, head_dim] -> q: [T, H, Dh], k, v: [T, Hkv, Dh]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (*apply_rotary_qk(q, k, cos, sin), v)

    def project_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor):
        # x: [T, D] -> q: [S, H, Dh] of ``rows`` only, k, v: [T, Hkv, Dh] (the bits of ``project``'s rows)
        split = self.split_qkv()
        if split is None:
            q, k, v = self.project(x, cos, sin)
            return q[rows], k, v
        k, v = split.kv(x).view(-1, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, dim=1)
        q = split.q(x[rows]).view(-1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos[rows], sin[rows]), apply_rotary(k, cos, sin), v

    def split_qkv(self) -> SplitQKV | None:
        return SplitQKV.of(self.qkv, self.num_heads * self.head_dim)

    def attend(self, q, k, v, kv_cache: dict[str, torch.Tensor], attn_meta: AttentionMetadata) -> torch.Tensor:
        # -> [T, H, Dh]; writes k, v into the paged cache
        return paged_attention(q, k, v, kv_cache, attn_meta, self.scale, self.sliding_window)

    def load(self, src, prefix: str, tp_rank: int) -> None:
        self.qkv.load(src, (f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"), tp_rank)
        self.o_proj.load(src, f"{prefix}.o_proj", tp_rank)
        if self.q_norm is not None:
            self.q_norm.load(src, f"{prefix}.q_norm")
            self.k_norm.load(src, f"{prefix}.k_norm")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes):
        super().__init__()
        self.layer = layer                                               # global index
        eps, dt = config.rms_norm_eps, config.dtype
        self.input_norm = RMSNorm(config.hidden_size, eps, dt)
        self.attn = Attention(config, layer, shard.num_heads, shard.num_kv_heads)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps, dt)
        self.mlp = make_mlp(config, layer, shard)                        # GatedMLP, or MoE on an MoE layer

    def forward(self, h: torch.Tensor, cos, sin, kv_cache, attn_meta, pieces: LayerPieces | None = None):
        # h: [T, D] -> [T, D]; attention runs eagerly between the two pieces (compiled or not)
        pieces = pieces or EAGER_PIECES
        q, k, v = pieces.before_attention(self, h, cos, sin)
        return pieces.after_attention(self, h, self.attn.attend(q, k, v, kv_cache, attn_meta))

    def forward_rows(self, h: torch.Tensor, cos, sin, kv_cache, attn_meta, keep: LogitRows) -> torch.Tensor:
        # h: [T, D] -> [S, D]: every row's K/V into the cache, the query, attention and the MLP for ``keep.rows``
        # only (eager)
        r = keep.rows
        q, k, v = self.attn.project_rows(self.input_norm(h), cos, sin, r)     # q: [S, H, Dh]; k, v: [T, Hkv, Dh]
        write_to_cache(k, v, kv_cache, attn_meta.slot_mapping, attn_meta.backend)
        if not r.numel():                                # a step that samples nothing: no row goes on
            return h[:0]
        out = self.attn.attend(q, k[r], v[r], kv_cache, keep.attn)   # writes those rows' K/V again: same bytes
        return self.after_attention(h[r], out)

    def forward_fused(self, h: torch.Tensor, pending: torch.Tensor | None, cos, sin, kv_cache, attn_meta):
        """``forward`` with each residual add fused into the norm after it (``RMSNorm.add_norm``), eager:
        (residual h, the previous layer's MLP output not yet added to it, or None) -> the same pair after this
        layer. ``LlamaForCausalLM._layers_fused`` threads the pair through the layers; the adds and norms are
        the ones ``forward`` runs, in the same order."""
        x, h = self.input_norm.add_norm(pending, h)
        q, k, v = self.attn.project(x, cos, sin)
        out = self.attn.attend(q, k, v, kv_cache, attn_meta)
        x, h = self.post_attn_norm.add_norm(self.attn.o_proj(out.flatten(1)), h)
        return h, self.mlp(x)

    def rows_independent(self) -> bool:
        """Whether this layer's matmuls after attention give a row the same bits at any row count (fp32 on
        oneDNN with the few-row panels), so ``forward_rows`` may run them for some rows only."""
        return self.attn.o_proj.rows_independent() and self.mlp.rows_independent()

    def before_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # h: [T, D] -> q: [T, H, Dh], k, v: [T, Hkv, Dh]
        return self.attn.project(self.input_norm(h), cos, sin)

    def after_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # h: [T, D], attn_out: [T, H, Dh] -> [T, D]
        h = self.attn.o_proj.plus(attn_out.flatten(1), h)
        return self.mlp.plus(self.post_attn_norm(h), h)

    def load(self, src, tp_rank: int) -> None:
        prefix = f"model.layers.{self.layer}"
        self.input_norm.load(src, f"{prefix}.input_layernorm")
        self.attn.load(src, f"{prefix}.self_attn", tp_rank)
        self.post_attn_norm.load(src, f"{prefix}.post_attention_layernorm")
        self.mlp.load(src, f"{prefix}.mlp", tp_rank)


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer           # DeepSeek's model is this one with its MLA layer (``deepseek.py``)
    supports_compile = True              # the runner may torch.compile this layer's pieces (``runner/compile.py``)

    def __init__(self, config: ModelConfig, first_layer: int = 0, num_layers: int | None = None,
                 shard: ShardSizes | None = None):
        super().__init__()
        num_layers = config.num_layers - first_layer if num_layers is None else num_layers
        if not (0 <= first_layer and 0 < num_layers and first_layer + num_layers <= config.num_layers):
            raise ValueError(f"layer range [{first_layer}, {first_layer + num_layers}) is outside the "
                             f"model's {config.num_layers} layers")
        self.config, self.first_layer, self.num_layers = config, first_layer, num_layers
        self.is_first = first_layer == 0
        self.is_last = first_layer + num_layers == config.num_layers
        shard = shard or ShardSizes.full(config)
        dt = config.dtype
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)
        v = config.vocab_size
        self.embed_tokens = Embedding(shard.vocab_size, config.hidden_size, dt, v) if self.is_first else None
        self.layers = nn.ModuleList(self.layer_class(config, first_layer + i, shard) for i in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt) if self.is_last else None
        self.lm_head = LMHead(config.hidden_size, shard.vocab_size, dt, v) if self.is_last else None   # -> [N, v]
        if config.tie_word_embeddings and self.is_first and self.is_last:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[dict[str, torch.Tensor]], attn_meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, pieces: LayerPieces | None = None,
                logit_rows: LogitRows | None = None) -> torch.Tensor:
        # input_ids, positions: [T]; hidden: [T, D] from the previous stage (later stages only)
        # -> [T, D], or [S, D] for ``logit_rows`` (the last stage only)
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_layers} layers")
        if logit_rows is not None and not self.is_last:
            raise ValueError("logit_rows needs the model's last layer (a pipeline's last stage)")
        h = self.embed_tokens(input_ids) if hidden is None else hidden               # [T, D]
        seq_lens = _rope_seq_lens(positions, attn_meta) if self.rotary.dynamic else None
        # [T, Dh] each: in h's dtype once per step, eager; float32 into the compiled pieces (cast in their graph)
        cos, sin = self.rotary(positions, seq_lens, h.dtype if pieces is None else None)
        if pieces is None and fused_ops.norm_on(h):
            return self._layers_fused(h, cos, sin, kv_caches, attn_meta, logit_rows)
        last = self.num_layers - 1 if logit_rows is not None else -1
        hooks = attn_meta.layer_hooks
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if hooks is not None:
                hooks.before(i)
            if i == last:
                h = layer.forward_rows(h, cos, sin, kv_cache, attn_meta, logit_rows)   # [S, D], eager
            else:
                h = layer(h, cos, sin, kv_cache, attn_meta, pieces)
            if hooks is not None:
                hooks.after(i)
        return self.norm(h) if self.is_last else h                                   # [T or S, D]

    def _layers_fused(self, h, cos, sin, kv_caches, attn_meta, logit_rows: LogitRows | None) -> torch.Tensor:
        """``forward``'s layers and final norm with every residual add fused into the next norm (CUDA, where
        ``fused_ops.norm_on``): each layer hands its MLP output on unadded (``DecoderLayer.forward_fused``); the
        final norm adds the last one, a non-last pipeline stage adds it itself (the next stage takes a plain h)."""
        pending = None
        last = self.num_layers - 1 if logit_rows is not None else -1
        hooks = attn_meta.layer_hooks
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if hooks is not None:
                hooks.before(i)
            if i == last:                                 # the rows-only last layer takes a plain h
                h = h if pending is None else h + pending
                h, pending = layer.forward_rows(h, cos, sin, kv_cache, attn_meta, logit_rows), None
            else:
                h, pending = layer.forward_fused(h, pending, cos, sin, kv_cache, attn_meta)
            if hooks is not None:
                hooks.after(i)
        if self.is_last:
            return self.norm.add_norm(pending, h)[0]                                 # [T or S, D]
        return h if pending is None else h + pending

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, D] -> logits: [N, V] float32
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, src, tp_rank: int = 0) -> None:
        """Copy this rank's share of every parameter from ``src`` (a ``WeightSource``, HF names)."""
        if self.embed_tokens is not None:
            self.embed_tokens.load(src, "model.embed_tokens", tp_rank)
        for layer in self.layers:
            layer.load(src, tp_rank)
        if self.is_last:
            self.norm.load(src, "model.norm")
            self._load_lm_head(src, tp_rank)
        for module in self.modules():           # a tied LM head's weight was written through the embedding
            if isinstance(module, Linear):
                module.forget_reordered()

    def _load_lm_head(self, src, tp_rank: int) -> None:
        if not self.config.tie_word_embeddings:
            self.lm_head.load(src, "lm_head", tp_rank)
        elif self.embed_tokens is None:          # tied, but the embedding lives on the first stage
            self.lm_head.load(src, "model.embed_tokens", tp_rank)


EAGER_PIECES = LayerPieces(DecoderLayer.before_attention, DecoderLayer.after_attention)


def _rope_seq_lens(positions: torch.Tensor, attn_meta: AttentionMetadata) -> torch.Tensor:
    """[T]: the length each row's sequence reaches in this step (HF's dynamic-RoPE seq_len)."""
    qsl = attn_meta.query_start_loc
    return torch.repeat_interleave(attn_meta.seq_lens.long(), (qsl[1:] - qsl[:-1]).long(),
                                   output_size=positions.numel())
