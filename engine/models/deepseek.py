"""DeepSeek V2 / V3: ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM`` over HF checkpoints as transformers writes them.

The decoder is Llama's (``llama.LlamaForCausalLM``: embedding, layer loop, final norm, LM head, pipeline stages,
the fused CUDA path) with another layer, ``DeepseekDecoderLayer``: MLA attention (``mla.py``) and a dense gated
MLP. Called like every model (``pdserve.engine.models.__init__``):

    hidden = model(input_ids, positions, kv_caches, attn_meta)     # kv_caches[i]: {"latent": [N, bs, 1, L + R]}
    logits = model.compute_logits(hidden[sample_rows])

Checkpoint names (``model.layers.{i}.``): ``input_layernorm``, ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}``, ``self_attn.kv_a_proj_with_mqa``, ``self_attn.kv_a_layernorm``, ``self_attn.kv_b_proj``,
``self_attn.o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``. V2 and V3 differ in what the
config says (V3's ``rope_interleave``; their MoE routing), not in code. The rotary embedding covers the
``qk_rope_head_dim`` part of a head (``ModelConfig.head_dim``), with YaRN's attention factor on cos/sin.

Mixture-of-experts layers (``first_k_dense_replace`` < num_hidden_layers) are refused here with a clear error until
the MoE layer is wired in; a config whose layers are all dense is a valid DeepSeek.
No ``torch.compile`` pieces (``supports_compile``): the layer runs eagerly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdserve.engine.models.layers import GatedMLP, RMSNorm
from pdserve.engine.models.llama import LlamaForCausalLM, LogitRows, ShardSizes
from pdserve.engine.models.mla import MLAAttention
from pdserve.engine.models.model_config import ModelConfig, ModelConfigError, _read_json


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes):
        super().__init__()
        self.layer = layer                                               # global index
        eps, dt = config.rms_norm_eps, config.dtype
        self.input_norm = RMSNorm(config.hidden_size, eps, dt)
        self.attn = MLAAttention(config, layer, shard.num_heads)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps, dt)
        self.mlp = GatedMLP(config.hidden_size, shard.intermediate_size, config.mlp_bias, dt)

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

    def __init__(self, config: ModelConfig, first_layer: int = 0, num_layers: int | None = None,
                 shard: ShardSizes | None = None):
        _check_dense(config)
        super().__init__(config, first_layer, num_layers, shard)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's differences are config values: ``rope_interleave`` (``MLAConfig``) and its MoE routing."""


def _check_dense(config: ModelConfig) -> None:
    cfg = _read_json(Path(config.model_dir) / "config.json", required=False)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("n_routed_experts") and first_dense < config.num_layers:
        raise ModelConfigError(f"{config.model_dir}: layers {first_dense}..{config.num_layers - 1} are mixture-of-"
                               f"experts (first_k_dense_replace {first_dense} < num_hidden_layers "
                               f"{config.num_layers}); pdserve's DeepSeek runs dense MLP layers only so far")
