"""Tiny random DeepSeek V2 / V3 checkpoints: ``pdserve make-tiny-model DIR --arch deepseek_v2|deepseek_v3``.

``tiny_model.make_tiny_model`` hands these two archs here; the directory has the same files as its other tiny
models (config.json as transformers 5 writes a DeepseekV2Config / DeepseekV3Config, generation_config.json,
fp32 safetensors with HF names, the tiny tokenizer), so HF transformers and pdserve's loader both read it.

MLA shape: ``kv_lora_rank`` 32, ``qk_nope_head_dim`` 16, ``qk_rope_head_dim`` 8, ``v_head_dim`` 16 by default
(a cached token is 40 values a layer); ``q_lora_rank`` None (V2-Lite's q_proj) or a rank (q_a_proj, q_a_layernorm,
q_b_proj). Layer 0 is dense and the others MoE (``first_k_dense_replace`` 1, as DeepSeek's own configs start dense):
4 routed experts of ``moe_intermediate_size`` 32, top 2, one shared expert; V2 routes by softmax (greedy), V3 by
sigmoid with grouped top-k (2 groups, 1 kept) and ``e_score_correction_bias``; checkpoint names per expert
(``mlp.experts.{e}.{gate,up,down}_proj``), ``mlp.gate``, ``mlp.shared_experts``. ``rope``
optionally YaRN with mscale / mscale_all_dim (DeepSeek's own settings); V3 keeps ``rope_interleave`` True unless told.
Weights are drawn like ``tiny_model.random_weights`` (the same scales, one generator in a fixed order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.checkpoints.tiny_files import (EMBED_STD, LOGIT_STD, NORM_STD, PROJ_GAIN, save_weights,
                                                   write_tokenizer_files)
from pdserve.engine.checkpoints.tiny_tokenizer import FLAVOURS

ARCHS = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class TinyDeepseek:
    arch: str = "deepseek_v3"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate_size: int = 128
    first_k_dense_replace: int = 1               # >= num_layers: every layer dense
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    rope_interleave: bool = True                 # V3 only (V2 always interleaves)
    yarn: bool = False                           # YaRN x4 over 64 positions with DeepSeek's mscale settings
    max_position_embeddings: int = 2048


def hf_config(spec: TinyDeepseek, vocab_size: int, bos_id: int | None, eos_id: int) -> dict:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    max_pos = spec.max_position_embeddings
    if spec.yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
        max_pos = 2048
    config = {
        "architectures": [ARCHS[spec.arch]], "model_type": spec.arch, "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads, "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim, "head_dim": spec.qk_rope_head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos, "rope_parameters": rope,
        "rope_theta": rope["rope_theta"], "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "first_k_dense_replace": spec.first_k_dense_replace, "moe_layer_freq": 1,
        "n_routed_experts": spec.n_routed_experts, "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size, "n_shared_experts": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "bos_token_id": bos_id, "eos_token_id": eos_id, "initializer_range": 0.02,
        "use_cache": True, "dtype": "float32",
    }
    if spec.arch == "deepseek_v2":
        config.update(mlp_bias=False, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False)
    else:
        config.update(rope_interleave=spec.rope_interleave, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      topk_method="noaux_tc", scoring_func="sigmoid")
    return config


def param_shapes(spec: TinyDeepseek, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (the order weights are drawn in)."""
    d, h = spec.hidden_size, spec.num_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, d)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        if spec.q_lora_rank is None:
            shapes[p + "self_attn.q_proj.weight"] = (h * qk, d)
        else:
            shapes[p + "self_attn.q_a_proj.weight"] = (spec.q_lora_rank, d)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (spec.q_lora_rank,)
            shapes[p + "self_attn.q_b_proj.weight"] = (h * qk, spec.q_lora_rank)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (spec.kv_lora_rank + spec.qk_rope_head_dim, d)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (spec.kv_lora_rank,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (h * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank)
        shapes[p + "self_attn.o_proj.weight"] = (d, h * spec.v_head_dim)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes.update(_mlp_shapes(spec, i))
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab_size, d)
    return shapes


def _mlp_shapes(spec: TinyDeepseek, layer: int) -> dict[str, tuple[int, ...]]:
    p, d = f"model.layers.{layer}.mlp.", spec.hidden_size
    if layer < spec.first_k_dense_replace:
        return {p + "gate_proj.weight": (spec.intermediate_size, d), p + "up_proj.weight": (spec.intermediate_size, d),
                p + "down_proj.weight": (d, spec.intermediate_size)}
    w, shapes = spec.moe_intermediate_size, {p + "gate.weight": (spec.n_routed_experts, d)}
    if spec.arch == "deepseek_v3":
        shapes[p + "gate.e_score_correction_bias"] = (spec.n_routed_experts,)
    for e in range(spec.n_routed_experts):
        q = f"{p}experts.{e}."
        shapes.update({q + "gate_proj.weight": (w, d), q + "up_proj.weight": (w, d), q + "down_proj.weight": (d, w)})
    q = p + "shared_experts."                                                      # n_shared_experts 1
    shapes.update({q + "gate_proj.weight": (w, d), q + "up_proj.weight": (w, d), q + "down_proj.weight": (d, w)})
    return shapes


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, *, num_layers: int = 2, hidden_size: int = 64,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, shards: int = 1,
                    tie_word_embeddings: bool | None = None, rope_scaling: dict | None = None,
                    max_position_embeddings: int = 2048, head_dim: int | None = None, tokenizer: str = "bpe",
                    vocab_size: int | None = None) -> Path:
    """``tiny_model.make_tiny_model``'s keywords (its ``EXTRA_ARCHS`` hook) -> ``make_tiny_deepseek``. MLA has no KV
    heads (``num_kv_heads`` does not apply); a tied LM head, another head_dim or rope scaling are refused (DeepSeek
    has none of them; YaRN: ``make_tiny_deepseek(yarn=True)``)."""
    for name, value in (("tie_word_embeddings", tie_word_embeddings), ("rope_scaling", rope_scaling),
                        ("head_dim", head_dim)):
        if value:
            raise ValueError(f"{name}={value!r} does not apply to a tiny {arch} (MLA dims are its own fields)")
    return make_tiny_deepseek(out_dir, arch, seed, shards=shards, tokenizer=tokenizer, vocab_size=vocab_size,
                              num_layers=num_layers,
                              hidden_size=hidden_size, num_heads=num_heads, intermediate_size=intermediate_size,
                              max_position_embeddings=max_position_embeddings)


def make_tiny_deepseek(out_dir: str | Path, arch: str = "deepseek_v3", seed: int = 0, *, shards: int = 1,
                       tokenizer: str = "bpe", vocab_size: int | None = None, **shape) -> Path:
    """Write a random ``arch`` checkpoint (``TinyDeepseek`` fields in ``shape``) into ``out_dir``; -> its path.
    ``vocab_size``: rows of the embedding / LM head (default: the tokenizer's size rounded up to 64)."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {sorted(ARCHS)}")
    spec = TinyDeepseek(arch=arch, **shape)
    flavour = FLAVOURS[tokenizer]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = flavour.build(tokenizer)
    if vocab_size is not None and vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {tok.get_vocab_size()} tokens")
    vocab = vocab_size or -(-tok.get_vocab_size() // 64) * 64
    (out / "config.json").write_text(json.dumps(hf_config(spec, vocab, flavour.bos_id, flavour.eos_ids[0]),
                                                indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": flavour.bos_id, "eos_token_id": list(flavour.eos_ids), "pad_token_id": flavour.pad_id}) + "\n")
    save_weights(out, _random_weights(spec, vocab, seed), shards)
    write_tokenizer_files(out, tok, chat_template=flavour.chat_template, eos_token=flavour.eos_token,
                             bos_token=flavour.bos_token, pad_token=flavour.pad_token, unk_token=flavour.unk_token,
                             model_max_length=spec.max_position_embeddings)
    return out


def _random_weights(spec: TinyDeepseek, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    final_norm_scale = LOGIT_STD / (EMBED_STD * spec.hidden_size ** 0.5)
    weights = {}
    for name, shape in param_shapes(spec, vocab).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name == "model.norm.weight":
            weights[name] = final_norm_scale * (1.0 + NORM_STD * noise)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            weights[name] = 1.0 + NORM_STD * noise
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = EMBED_STD * noise
        elif name.endswith("e_score_correction_bias"):
            weights[name] = 0.1 * noise
        else:
            weights[name] = PROJ_GAIN / shape[1] ** 0.5 * noise
    return weights
