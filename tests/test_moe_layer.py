"""The MoE block (``engine/models/moe.py``): config parsing, routing against HF transformers' routers, the grouped
matmul against the per-expert loop, the whole block against HF's block, and its tensor-parallel split.

Routing is compared bit for bit (the same expert ids in the same order, the same float32 weights) with the router
modules of transformers itself, fed the same weights and inputs, for every family and top-k method; gate rows are
duplicated so that scores tie. The grouped matmul (``moe_ops.grouped_moe``) is bit-identical to the loop in fp32,
close in bf16.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.models.loader import WeightSource
from pdserve.engine.models.moe import MoE
from pdserve.engine.models.moe_config import MoEConfig, MoEConfigError
from pdserve.kernels import moe_ops

tf = pytest.importorskip("transformers")

H, E = 32, 8


def _hf_config(family: str, **over):
    base = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**base, num_experts=E, moe_intermediate_size=16, **{"norm_topk_prob": True, **over})
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**base, num_experts=E, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                 norm_topk_prob=False, **over)
    if family == "mixtral":
        return tf.MixtralConfig(**{**base, "intermediate_size": 16}, num_local_experts=E, **over)
    ds = dict(n_routed_experts=E, moe_intermediate_size=16, n_shared_experts=2, kv_lora_rank=16, q_lora_rank=None,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(**base, **ds, **{"topk_method": "greedy", "routed_scaling_factor": 1.5, **over})
    return tf.DeepseekV3Config(**base, **ds, **{"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, **over})


ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
ROUTING_CASES = {"qwen3_moe": {}, "qwen3_moe-unnormalised": {"norm_topk_prob": False}, "mixtral": {},
                 "deepseek_v2": {}, "deepseek_v2-groups": {"topk_method": "group_limited_greedy", "n_group": 4,
                                                          "topk_group": 2},
                 "deepseek_v3": {}, "deepseek_v3-unnormalised": {"norm_topk_prob": False},
                 "deepseek_v3-one-group": {"n_group": 1, "topk_group": 1}}


def _block(family: str, config, seed: int = 0):
    """HF's MoE block for ``family`` with random weights (its router's gate rows 1 and 5 equal: ties)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock,
           "deepseek_v2": DeepseekV2Moe, "deepseek_v3": DeepseekV3MoE}[family]
    torch.manual_seed(seed)
    block = cls(config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 * (3.0 if name == "gate.weight" else 1.0))
        block.gate.weight[5] = block.gate.weight[1]
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    return block


def _checkpoint(block, family: str, path, fused: bool = False) -> WeightSource:
    """``block``'s weights under layer 0's checkpoint names, one expert at a time (as save_pretrained writes) or
    in transformers 5's fused layout."""
    prefix = "model.layers.0." + ("block_sparse_moe" if family == "mixtral" and not fused else "mlp")
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    tensors = {}
    for name, t in block.state_dict().items():
        if name == "experts.gate_up_proj" and not fused:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}.experts.{e}.{names[0]}.weight"] = t[e, :inter]
                tensors[f"{prefix}.experts.{e}.{names[1]}.weight"] = t[e, inter:]
        elif name == "experts.down_proj" and not fused:
            for e in range(t.shape[0]):
                tensors[f"{prefix}.experts.{e}.{names[2]}.weight"] = t[e]
        else:
            tensors[f"{prefix}.{name}"] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return WeightSource(path)


def _ours(family: str, config, src, tp_size: int = 1, tp_rank: int = 0) -> MoE:
    cfg = MoEConfig.from_hf(ARCH[family], config.to_dict())
    moe = MoE(H, cfg, tp_size, torch.float32)
    with torch.no_grad():
        moe.load(src, "model.layers.0.mlp", tp_rank)
    return moe


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_is_hf_bit_for_bit(case, tmp_path):
    family = case.split("-")[0]
    config = _hf_config(family, **ROUTING_CASES[case])
    block = _block(family, config)
    ours = _ours(family, config, _checkpoint(block, family, tmp_path))
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    x[7] = x[3]
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = ours.route(x)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == torch.float32 and torch.equal(weights, hf_weights.float())


@pytest.mark.parametrize("family", list(ARCH))
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-layout"])
def test_block_matches_hf_block(family, fused, tmp_path):
    config = _hf_config(family)
    block = _block(family, config, seed=2)
    ours = _ours(family, config, _checkpoint(block, family, tmp_path, fused))
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), block(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_tp_shards_sum_to_the_whole_block(family, tmp_path):
    """Each of 2 ranks holds half of every expert's width (and of the shared expert's); their partial outputs
    (before the one all-reduce) sum to the unsplit block's."""
    config = _hf_config(family)
    src = _checkpoint(_block(family, config, seed=3), family, tmp_path)
    whole = _ours(family, config, src)
    ranks = [_ours(family, config, src, tp_size=2, tp_rank=r) for r in (0, 1)]
    assert ranks[0].w13.shape == (E, 16, H) and ranks[0].w2.shape == (E, H, 8)
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), atol=1e-5, rtol=1e-5)
    calls = []
    ranks[0].attach_collective(lambda y: calls.append(y) or y)
    with torch.no_grad():
        ranks[0](x)
    assert len(calls) == 1                                  # one all-reduce per MoE layer, shared expert included


def _routed(T, k, H_, inter, experts, seed, dtype=torch.float32, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H_, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, H_, generator=g) / H_ ** 0.5).to(dtype)
    w2 = (torch.randn(experts, H_, inter, generator=g) / inter ** 0.5).to(dtype)
    hi = min(experts, k + 1) if skew else experts
    ids = torch.stack([torch.randperm(hi, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()
    return x, w13, w2, torch.rand(T, k, generator=g), ids


@pytest.mark.parametrize("T,k,H_,inter,skew", [(1, 2, 32, 16, False), (50, 2, 64, 32, False), (50, 2, 64, 32, True),
                                               (33, 1, 32, 8, False), (7, 2, 30, 10, False),
                                               (40, 6, 32, 16, False)])
def test_grouped_matmul_equals_the_per_expert_loop_bit_for_bit(T, k, H_, inter, skew):
    """The same rows through the same matmuls, added into each token in expert order -- the same bits. (H 30, I 10:
    widths grouped_mm refuses, run segment by segment.)"""
    args = _routed(T, k, H_, inter, 8, seed=T, skew=skew)
    assert torch.equal(moe_ops.grouped_moe(*args), moe_ops.loop_moe(*args))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_grouped_matmul_close_to_the_loop_at_top_6(dtype, tol):
    args = _routed(40, 6, 32, 16, 16, seed=9, dtype=dtype)
    torch.testing.assert_close(moe_ops.grouped_moe(*args).float(), moe_ops.loop_moe(*args).float(),
                               atol=tol, rtol=tol)


def test_no_tokens():
    x, w13, w2, weights, ids = _routed(0, 2, 32, 16, 8, seed=0)
    assert moe_ops.grouped_moe(x, w13, w2, weights, ids).shape == (0, 32)


def test_moe_layers_of_each_family_match_hf():
    """``is_moe_layer`` against the rule each HF model builds its layers with."""
    qwen = tf.Qwen3MoeConfig(num_hidden_layers=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                             mlp_only_layers=[3, 5])
    cfg = MoEConfig.from_hf(ARCH["qwen3_moe"], qwen.to_dict())
    assert [cfg.is_moe_layer(i) for i in range(8)] == [
        i not in qwen.mlp_only_layers and (i + 1) % qwen.decoder_sparse_step == 0 for i in range(8)]
    ds = MoEConfig.from_hf(ARCH["deepseek_v3"], {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 16, "first_k_dense_replace": 3,
                                                 "n_group": 2, "topk_group": 1, "moe_layer_freq": 2})
    assert [ds.is_moe_layer(i) for i in range(8)] == [False] * 3 + [True] * 5      # HF ignores moe_layer_freq
    assert ds.scoring == "sigmoid" and ds.topk_method == "noaux_tc" and ds.norm_topk_prob and not ds.sorted_topk
    assert all(MoEConfig.from_hf("MixtralForCausalLM", _hf_config("mixtral").to_dict()).is_moe_layer(i)
               for i in range(4))
    assert MoEConfig.from_hf("LlamaForCausalLM", {}) is None


@pytest.mark.parametrize("over,match", [({"n_group": 3}, "must divide into the groups"),
                                        ({"topk_group": 5}, "1 <= topk_group <= n_group"),
                                        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
                                        ({"scoring_func": "relu"}, "scoring_func 'relu'"),
                                        ({"n_group": 8, "topk_group": 2}, "two best experts")])
def test_bad_layouts_are_refused_with_the_value(over, match):
    cfg = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 4,
           "topk_group": 2, **over}
    with pytest.raises(MoEConfigError, match=match):
        MoEConfig.from_hf(ARCH["deepseek_v3"], cfg)


def _plain_route(logits: list[float], cfg: MoEConfig, bias: list[float]) -> dict[int, float]:
    """One token's routing written out plainly (no ties here): -> {expert: weight}."""
    import math

    E, per = cfg.num_experts, cfg.num_experts // cfg.num_groups
    if cfg.scoring == "softmax":
        z = sum(math.exp(v - max(logits)) for v in logits)
        scores = [math.exp(v - max(logits)) / z for v in logits]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)] if cfg.topk_method == "noaux_tc" else scores
    allowed = set(range(E))
    if cfg.grouped:
        def group_score(g):
            best = sorted(choice[g * per:(g + 1) * per], reverse=True)
            return best[0] if cfg.topk_method == "group_limited_greedy" else best[0] + best[1]
        groups = sorted(range(cfg.num_groups), key=group_score, reverse=True)[:cfg.topk_groups]
        allowed = {e for g in groups for e in range(g * per, (g + 1) * per)}
    chosen = sorted(allowed, key=lambda e: choice[e], reverse=True)[:cfg.top_k]
    weights = {e: scores[e] for e in chosen}
    total = sum(weights.values())
    return {e: w / (total if cfg.norm_topk_prob else 1.0) * cfg.routed_scaling_factor for e, w in weights.items()}


@pytest.mark.parametrize("over", [
    dict(scoring="softmax", norm_topk_prob=True),
    dict(scoring="softmax", routed_scaling_factor=16.0, topk_method="group_limited_greedy", num_groups=4,
         topk_groups=2),
    dict(scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc", num_groups=4,
         topk_groups=2),
    dict(scoring="sigmoid", norm_topk_prob=False, topk_method="noaux_tc", num_groups=2, topk_groups=1),
], ids=["softmax-renorm", "v2-groups-scaled", "v3-noaux", "v3-one-of-two-groups"])
def test_routing_equals_a_plain_per_token_reference(over):
    from pdserve.engine.models.moe_routing import route

    cfg = MoEConfig(num_experts=16, top_k=3, intermediate_size=8, **over)
    g = torch.Generator().manual_seed(11)
    logits, bias = torch.randn(40, 16, generator=g) * 2, torch.randn(16, generator=g) * 0.3
    weights, ids = route(logits, cfg, bias)
    for t in range(40):
        want = _plain_route(logits[t].tolist(), cfg, bias.tolist())
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), t
        assert all(abs(got[e] - want[e]) < 1e-5 * max(1.0, abs(want[e])) for e in want), (t, got, want)
