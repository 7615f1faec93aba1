"""DeepSeek V2 / V3 (MLA) against HF transformers on tiny random checkpoints (fp32), and MLA's config and KV layout.

Each model is built by transformers itself (DeepseekV2Config / DeepseekV3Config; dense layers, or layer 1 MoE with
the MoE layer of ``moe.py``), saved, loaded
by pdserve's loader and compared on logits: a 20-token prefill (the plain path) then one decode step through the
latent cache (the weight-absorbed path), as ``test_models.py`` does for the dense families.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from pdserve.engine.models.loader import load_model
from pdserve.engine.models.mla_config import MLAConfig
from pdserve.engine.models.model_config import ModelConfig
from test_models import PROMPT_LEN, hf_logits, run_prefill_then_decode

torch.set_num_threads(1)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256, intermediate_size=96,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 0.707, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}


def make_hf_deepseek(arch: str, path, seed: int = 0, **overrides):
    cls = {"v2": transformers.DeepseekV2Config, "v3": transformers.DeepseekV3Config}[arch]
    extra = {"n_group": 2, "topk_group": 1} if arch == "v3" else {}
    config = cls(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls.__name__.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    return model


CASES = {
    "v2-q-lora": ("v2", {"q_lora_rank": 48}),
    "v2-no-q-lora": ("v2", {"q_lora_rank": None}),
    "v3-q-lora": ("v3", {"q_lora_rank": 48}),
    "v3-no-q-lora": ("v3", {"q_lora_rank": None}),
    "v3-rotate-half": ("v3", {"q_lora_rank": 48, "rope_interleave": False}),
    "v2-yarn": ("v2", {"q_lora_rank": None, "max_position_embeddings": 64, "rope_parameters": YARN}),
    "v3-yarn": ("v3", {"q_lora_rank": 48, "max_position_embeddings": 64, "rope_parameters": YARN}),
    "v3-bias": ("v3", {"q_lora_rank": 48, "attention_bias": True}),
    # layer 1 MoE (moe.py): V2 softmax greedy / group-limited, V3 sigmoid noaux_tc with the correction bias
    "v2-moe": ("v2", {"q_lora_rank": None, "first_k_dense_replace": 1, "n_shared_experts": 1}),
    "v2-moe-groups": ("v2", {"q_lora_rank": 48, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
                             "n_group": 2, "topk_group": 1}),
    "v3-moe": ("v3", {"q_lora_rank": 48, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_absorbed_decode_match_hf(tmp_path, case):
    arch, overrides = CASES[case]
    hf = make_hf_deepseek(arch, tmp_path, **overrides)
    ids = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(1))
    model, config = load_model(tmp_path)
    ours, ref = run_prefill_then_decode(model, config, ids), hf_logits(hf, ids)
    assert ref.std() > 0.5, "reference logits are flat: the test would not see a wrong model"
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert config.mla is not None and config.mla.q_lora_rank == overrides["q_lora_rank"]


def test_mla_config_and_latent_layout(tmp_path):
    make_hf_deepseek("v3", tmp_path, q_lora_rank=48, max_position_embeddings=64, rope_parameters=YARN)
    config = ModelConfig.from_dir(tmp_path)
    m = config.mla
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 16, 8, 12)
    assert m.rope_interleave and m.latent_dim == 40 and config.head_dim == 8
    mscale = 0.1 * 0.707 * math.log(4.0) + 1.0                       # YaRN mscale(factor 4, mscale_all_dim)
    assert m.softmax_scale == pytest.approx(24 ** -0.5 * mscale * mscale)
    layout = config.kv_layout()
    assert layout.kind == "mla" and layout.components == ("latent",) and layout.token_shape == (1, 40)
    assert layout.bytes_per_token == 2 * 40 * 4                     # layers x (L + R) x fp32, nothing per head
    assert layout.tp_replicated and layout.describe() == "mla:latent=32:rope=8:torch.float32"
    caches = layout.allocate(3, 4)
    assert list(caches[0]) == ["latent"] and caches[0]["latent"].shape == (3, 4, 1, 40)
    assert config.kv_layout(num_kv_heads=1, num_layers=1, first_layer=1).token_shape == (1, 40)   # TP: replicated


def test_v2_always_interleaves_and_default_rope_keeps_scale(tmp_path):
    make_hf_deepseek("v2", tmp_path, q_lora_rank=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_dir(tmp_path)
    m = MLAConfig.from_hf("DeepseekV2ForCausalLM", {**cfg, "rope_interleave": False}, config.rope)
    assert m.rope_interleave and m.softmax_scale == 24 ** -0.5 and m.q_lora_rank is None
