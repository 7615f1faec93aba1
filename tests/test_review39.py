"""Review of issue 39 (vocab padding, MoE, DeepSeek MLA): reproductions of what the review found, against HF
transformers fp32 on tiny random checkpoints that transformers itself writes (``test_deepseek.make_hf_deepseek``).

- A DeepSeek config.json with ``moe_layer_freq`` 2: transformers ignores the key (MoE on every layer from
  ``first_k_dense_replace``) and writes every layer's experts; pdserve made odd layers dense and could not load
  the checkpoint (``model.layers.1.mlp.gate_proj.weight`` missing).
- A DeepSeek config.json that leaves out MoE / MLA keys: transformers builds the model with its config class's
  defaults (V3: one shared expert, routed_scaling_factor 2.5, n_group 8 / topk_group 4, first_k_dense_replace 3;
  V2: two shared experts; both: q_lora_rank 1536); pdserve used 0 shared experts, scale 1, one group, and ran
  without the checkpoint's shared experts -- silently other logits. Likewise Qwen2-MoE without
  ``shared_expert_intermediate_size`` (transformers: 5632 wide, always built; pdserve: no shared expert).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pdserve.engine.models.loader import load_model
from test_deepseek import TINY, make_hf_deepseek
from test_models import PROMPT_LEN, hf_logits, run_prefill_then_decode

torch.set_num_threads(1)


def _assert_logits_match(hf, path):
    ids = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(1))
    model, config = load_model(path)
    ours, ref = run_prefill_then_decode(model, config, ids), hf_logits(hf, ids)
    assert ref.std() > 0.5
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    return config


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_moe_layer_freq_2_loads_and_matches_hf(tmp_path, arch):
    hf = make_hf_deepseek(arch, tmp_path, q_lora_rank=None, first_k_dense_replace=0, moe_layer_freq=2)
    assert json.loads((tmp_path / "config.json").read_text())["moe_layer_freq"] == 2
    assert all("moe" in type(layer.mlp).__name__.lower() for layer in hf.model.layers)   # HF: MoE on 0 and 1
    config = _assert_logits_match(hf, tmp_path)
    assert [config.moe.is_moe_layer(i) for i in range(2)] == [True, True]


MISSING = {
    "v3-no-n_shared_experts": ("v3", ["n_shared_experts"], {}),
    "v3-no-routed_scaling_factor": ("v3", ["routed_scaling_factor"], {"routed_scaling_factor": 2.5}),
    "v3-no-groups": ("v3", ["n_group", "topk_group"], {"n_routed_experts": 16, "n_group": 8, "topk_group": 4}),
    "v3-no-first_k_dense_replace": ("v3", ["first_k_dense_replace"], {"num_hidden_layers": 4,
                                                                     "first_k_dense_replace": 3}),
    "v2-no-n_shared_experts": ("v2", ["n_shared_experts"], {"n_shared_experts": 2}),
    "v3-no-q_lora_rank": ("v3", ["q_lora_rank"], {"q_lora_rank": 1536}),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_config_without_a_key_means_transformers_default(tmp_path, case):
    arch, drop, overrides = MISSING[case]
    make_hf_deepseek(arch, tmp_path, **{"q_lora_rank": 48, "first_k_dense_replace": 1, **overrides})
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in drop:
        del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_logits_match(hf, tmp_path)


def test_qwen2_moe_without_the_shared_width_key_keeps_its_shared_expert(tmp_path):
    config = transformers.Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         vocab_size=TINY["vocab_size"], intermediate_size=96, num_hidden_layers=2,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=5632)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    model.eval().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["shared_expert_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.shared_expert_intermediate_size == 5632
    assert _assert_logits_match(hf, tmp_path).moe.shared_intermediate_size == 5632
