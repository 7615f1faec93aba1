"""What a DeepSeek V2/V3 config.json says about multi-head latent attention (MLA): ``MLAConfig.from_hf``.

Read by ``model_config._parse`` (attached to ``ModelConfig.mla``; None for every other architecture), then by the
MLA attention (``mla.py``: projections, the softmax scale, the rope layout) and by ``ModelConfig.kv_layout`` (one
latent component per token of ``kv_lora_rank + qk_rope_head_dim`` values).

Per token and layer MLA keeps one vector, the compressed KV ``c`` (``kv_lora_rank``) and the shared rope key
``k_pe`` (``qk_rope_head_dim``), instead of per-head K and V:

    q    = q_proj(x)  or  q_b_proj(rms(q_a_proj(x)))        [H, qk_nope + qk_rope]
    c    = rms(kv_a_proj(x)[:kv_lora_rank])                 [kv_lora_rank]          \\  cached: [c | rope(k_pe)]
    k_pe = kv_a_proj(x)[kv_lora_rank:]                      [qk_rope]               /
    k, v = kv_b_proj(c) split per head                      [H, qk_nope], [H, v_head_dim]

The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when YaRN scaling
asks for ``mscale_all_dim`` (DeepSeek's reference and transformers' ``yarn_apply_mscale``); YaRN's own
``attention_factor`` (mscale / mscale_all_dim) scales the rotary cos/sin in ``rope.py``.
Rope layout: transformers applies DeepSeek V2's rotary to interleaved pairs (x0, x1), (x2, x3), ... (complex
multiplication) and V3's the same when ``rope_interleave`` (its default), else as rotate-half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
HF_Q_LORA_RANK = 1536        # DeepseekV2Config's and DeepseekV3Config's default, for a config.json without the key


class MLAConfigError(ValueError):
    """config.json's MLA fields are missing or inconsistent."""


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None          # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool            # rotary on interleaved pairs (V2 always, V3 by default) vs rotate-half
    softmax_scale: float             # qk_head_dim ** -0.5, YaRN's mscale_all_dim correction included

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the compressed KV and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, architecture: str, cfg: dict, rope) -> MLAConfig | None:
        """``cfg``: config.json as a dict; ``rope``: the parsed ``RopeConfig``. None unless DeepSeek V2/V3."""
        if architecture not in MLA_ARCHITECTURES:
            return None
        dims = {}
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not cfg.get(name) or int(cfg[name]) < 1:
                raise MLAConfigError(f"config.json: {architecture} needs a positive {name}, got {cfg.get(name)!r}")
            dims[name] = int(cfg[name])
        if dims["qk_rope_head_dim"] % 2:
            raise MLAConfigError(f"config.json: qk_rope_head_dim {dims['qk_rope_head_dim']} must be even "
                                 f"(rotary pairs)")
        q_lora = cfg.get("q_lora_rank", HF_Q_LORA_RANK)    # absent: transformers' default; null: no q LoRA
        interleave = True if architecture == "DeepseekV2ForCausalLM" else bool(cfg.get("rope_interleave", True))
        scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5 * _mscale_all_dim_correction(rope)
        return cls(q_lora_rank=int(q_lora) if q_lora else None, rope_interleave=interleave, softmax_scale=scale,
                   **dims)

    def describe(self) -> str:
        return (f"q_lora={self.q_lora_rank}:kv_lora={self.kv_lora_rank}:nope={self.qk_nope_head_dim}:"
                f"rope={self.qk_rope_head_dim}:v={self.v_head_dim}")


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's ``0.1 * m * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _mscale_all_dim_correction(rope) -> float:
    """``mscale(factor, mscale_all_dim) ** 2`` for a scaled rope that names ``mscale_all_dim``, else 1."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    if rope.factor is None:
        raise MLAConfigError(f"config.json: rope type {rope.rope_type!r} with mscale_all_dim needs a factor")
    m = yarn_mscale(rope.factor, rope.mscale_all_dim)
    return m * m
