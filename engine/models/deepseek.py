"""DeepSeek V2 / V3: ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, over HF checkpoints as transformers
writes them.

The decoder is Llama's (``llama.LlamaForCausalLM``: embedding, layer loop, final norm, LM head, pipeline stages,
the fused CUDA path) with another layer, ``DeepseekDecoderLayer``: MLA attention (``mla.py``) and the MLP that
``moe.make_mlp`` gives the layer (a dense gated MLP below ``first_k_dense_replace``, ``moe_layer_freq`` ignored as
HF ignores it; else the MoE block with shared experts, V3's grouped top-k, ``e_score_correction_bias``,
``routed_scaling_factor``: ``moe.py``, ``moe_config.py``). Called like every model (``pdserve.engine.models.__init__``):

    hidden = model(input_ids, positions, kv_caches, attn_meta)     # kv_caches[i]: {"latent": [N, bs, 1, L + R]}
    logits = model.compute_logits(hidden[sample_rows])

Checkpoint names (``model.layers.{i}.``): ``input_layernorm``, ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}``, ``self_attn.kv_a_proj_with_mqa``, ``self_attn.kv_a_layernorm``, ``self_attn.kv_b_proj``,
``self_attn.o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (dense layers) or ``mlp.gate``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*`` (MoE layers: ``moe.MoE.load``). V2 and V3 differ in what the
config says (V3's ``rope_interleave``; their MoE routing), not in code. The rotary embedding covers the
``qk_rope_head_dim`` part of a head (``ModelConfig.head_dim``), with YaRN's attention factor on cos/sin.

No ``torch.compile`` pieces (``supports_compile``): the layer runs eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models.layers import RMSNorm
from pdserve.engine.models.llama import LlamaForCausalLM, LogitRows, ShardSizes
from pdserve.engine.models.mla import MLAAttention
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.moe import make_mlp


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes):
        super().__init__()
        self.layer = layer                                               # global index
        eps, dt = config.rms_norm_eps, config.dtype
        self.input_norm = RMSNorm(config.hidden_size, eps, dt)
        self.attn = MLAAttention(config, layer, shard.num_heads)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps, dt)
        self.mlp = make_mlp(config, layer, shard)                        # GatedMLP, or MoE on an MoE layer

    def forward(self, h: torch.Tensor, cos, sin, kv_cache, attn_meta, pieces=None) -> torch.Tensor:
        # h: [T, D] -> [T, D]
        if pieces is not None:
            raise ValueError("DeepSeek layers run eagerly: no torch.compile pieces (use --enforce-eager)")
        out = self.attn(self.input_norm(h), cos, sin, kv_cache, attn_meta)       # [T, H * v]
        h = self.attn.o_proj.plus(out, h)
        return self.mlp.plus(self.post_attn_norm(h), h)

    def forward_rows(self, h: torch.Tensor, cos, sin, kv_cache, attn_meta, keep: LogitRows) -> torch.Tensor:
        """[T, D] -> [S, D] of ``keep.rows``: the whole layer, then the rows (``rows_independent`` is False, so the
        runner does not ask for this; it is here for a caller that passes ``logit_rows`` anyway)."""
        return self.forward(h, cos, sin, kv_cache, attn_meta)[keep.rows]

    def forward_fused(self, h: torch.Tensor, pending: torch.Tensor | None, cos, sin, kv_cache, attn_meta):
        """(residual, the previous layer's unadded MLP output) -> the same pair after this layer (CUDA's fused
        residual-add + RMSNorm path, ``LlamaForCausalLM._layers_fused``)."""
        x, h = self.input_norm.add_norm(pending, h)
        x, h = self.post_attn_norm.add_norm(self.attn.o_proj(self.attn(x, cos, sin, kv_cache, attn_meta)), h)
        return h, self.mlp(x)

    def rows_independent(self) -> bool:
        return False

    def load(self, src, tp_rank: int) -> None:
        prefix = f"model.layers.{self.layer}"
        self.input_norm.load(src, f"{prefix}.input_layernorm")
        self.attn.load(src, f"{prefix}.self_attn", tp_rank)
        self.post_attn_norm.load(src, f"{prefix}.post_attention_layernorm")
        self.mlp.load(src, f"{prefix}.mlp", tp_rank)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer
    supports_compile = False


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's differences are config values: ``rope_interleave`` (``MLAConfig``) and its MoE routing (``MoEConfig``)."""
