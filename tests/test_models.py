"""Our model code and loader against HF transformers on tiny random checkpoints (fp32).

Each test builds a tiny HF model with transformers itself, saves it (safetensors), loads it with
``pdserve.engine.models.loader`` and compares logits: a ~20-token prefill, then one decode step through
the paged KV cache, against HF's logits at the same positions.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve.engine.models import UnsupportedArchitectureError
from pdserve.engine.models.loader import WeightError, WeightSource, load_model
from pdserve.engine.models.model_config import ModelConfig, ModelConfigError, resolve_dtype
from pdserve.engine.models.rope import inv_frequencies
from pdserve.kernels import AttentionMetadata

torch.set_num_threads(1)

PROMPT_LEN, BLOCK_SIZE = 20, 4
BLOCK_TABLE = [5, 2, 7, 0, 3, 6]          # deliberately not in order: 6 blocks hold 24 tokens
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, intermediate_size=96, head_dim=16)
CONFIGS = {
    "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
}


def make_hf_model(arch: str, path, seed: int = 0, **overrides):
    """Random tiny HF model saved to ``path``; weights spread out so logits are not flat."""
    shard_size = overrides.pop("max_shard_size", "5GB")
    torch.manual_seed(seed)
    config = CONFIGS[arch](**{**TINY, **overrides})
    model = getattr(transformers, config.__class__.__name__.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path, max_shard_size=shard_size)
    return model


def run_prefill_then_decode(model, config: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Logits [len(ids), V]: ids[:-1] as one prefill, then ids[-1] as a decode step."""
    caches = config.kv_layout(num_layers=model.num_layers).allocate(len(BLOCK_TABLE) + 2, BLOCK_SIZE)
    n = len(ids) - 1
    prefill = AttentionMetadata.build([n], [n], [BLOCK_TABLE], BLOCK_SIZE)
    decode = AttentionMetadata.build([1], [n + 1], [BLOCK_TABLE], BLOCK_SIZE)
    with torch.inference_mode():
        h1 = model(ids[:n], torch.arange(n), caches, prefill)
        h2 = model(ids[n:], torch.tensor([n]), caches, decode)
        return torch.cat([model.compute_logits(h1), model.compute_logits(h2)])


def hf_logits(hf_model, ids: torch.Tensor, decode_last: bool = True) -> torch.Tensor:
    """HF's logits [len(ids), V]; with ``decode_last`` the last token runs as a cached decode step."""
    with torch.inference_mode():
        if not decode_last:
            return hf_model(ids.unsqueeze(0)).logits[0].float()
        first = hf_model(ids[:-1].unsqueeze(0), use_cache=True)
        cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        last = hf_model(ids[-1:].unsqueeze(0), **{cache_arg: first.past_key_values})
        return torch.cat([first.logits[0], last.logits[0]]).float()


def assert_matches_hf(hf_model, path, **load_kwargs):
    ids = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(1))
    model, config = load_model(path, **load_kwargs)
    ours, ref = run_prefill_then_decode(model, config, ids), hf_logits(hf_model, ids)
    assert ref.std() > 0.5, "reference logits are flat: the test would not see a wrong model"
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return model, config


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": 8}),
    ("mistral", {"sliding_window": None}),
], ids=["llama", "llama-bias", "qwen2", "qwen2-sliding", "qwen3", "mistral-sliding", "mistral-full"])
def test_prefill_and_decode_match_hf(tmp_path, arch, overrides):
    hf = make_hf_model(arch, tmp_path, **overrides)
    model, config = assert_matches_hf(hf, tmp_path)
    assert config.architecture == hf.config.architectures[0]
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert all(not p.requires_grad for p in model.parameters()) and not model.training


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "dynamic", "factor": 2.0},
], ids=lambda r: r["rope_type"])
def test_rope_scaling_matches_hf(tmp_path, rope):
    # dynamic: max_position_embeddings 16 < 21 tokens, so the decode step and the prefill rescale
    max_pos = {"yarn": 64, "dynamic": 16}.get(rope["rope_type"], 2048)
    hf = make_hf_model("llama", tmp_path, max_position_embeddings=max_pos,
                       rope_parameters={"rope_theta": 5000.0, **rope})
    _, config = assert_matches_hf(hf, tmp_path)
    assert config.rope.rope_type == rope["rope_type"] and config.rope.theta == 5000.0


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0},
], ids=lambda r: r["rope_type"] + ("-mscale" if "mscale" in r else ""))
def test_inv_frequencies_equal_transformers(tmp_path, rope):
    """Full-size parameters (head_dim 128, theta 500000): our inv_freq and scaling equal HF's."""
    max_pos = rope.get("original_max_position_embeddings", 8192) * int(rope.get("factor", 1))
    hf_config = transformers.LlamaConfig(head_dim=128, max_position_embeddings=max_pos,
                                         architectures=["LlamaForCausalLM"],
                                         rope_parameters={"rope_theta": 500000.0, **rope})
    hf_config.save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    ours, our_scale = inv_frequencies(config.rope, 128, config.max_position_embeddings)
    if rope["rope_type"] == "default":
        ref, ref_scale = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq, 1.0
    else:
        ref, ref_scale = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert our_scale == pytest.approx(ref_scale, rel=1e-12)


def test_tied_embeddings_share_one_tensor(tmp_path):
    hf = make_hf_model("qwen2", tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in WeightSource(tmp_path)
    model, config = assert_matches_hf(hf, tmp_path)
    assert config.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_pipeline_stages_compose_to_the_full_model(tmp_path):
    """Layer ranges [0, 1) + [1, 2) equal the whole model; the tied last stage reads embed_tokens."""
    hf = make_hf_model("llama", tmp_path, tie_word_embeddings=True)
    first, config = load_model(tmp_path, num_layers=1)
    last, _ = load_model(tmp_path, first_layer=1)
    assert first.lm_head is None and last.embed_tokens is None and last.layers[0].layer == 1
    ids = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata.build([PROMPT_LEN], [PROMPT_LEN], [BLOCK_TABLE], BLOCK_SIZE)
    layout = config.kv_layout(num_layers=1)
    with torch.inference_mode():
        h = first(ids, torch.arange(PROMPT_LEN), layout.allocate(8, BLOCK_SIZE), meta)
        h = last(None, torch.arange(PROMPT_LEN), layout.allocate(8, BLOCK_SIZE), meta, hidden=h)
        torch.testing.assert_close(last.compute_logits(h), hf_logits(hf, ids, decode_last=False),
                                   atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model("mistral", tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    assert_matches_hf(hf, tmp_path)


def test_missing_tensor_names_tensor_and_file(tmp_path):
    make_hf_model("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        load_model(tmp_path)


def test_get_slice_reads_the_requested_rows_and_columns(tmp_path):
    make_hf_model("qwen2", tmp_path)
    src = WeightSource(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"          # [32, 64]
    full = src.get(name)
    assert src.shape(name) == (32, 64)
    torch.testing.assert_close(src.get_slice(name, 0, 16, 32), full[16:32], atol=0, rtol=0)
    torch.testing.assert_close(src.get_slice(name, 1, 8, 40), full[:, 8:40], atol=0, rtol=0)
    with pytest.raises(WeightError, match=r"slice \[16, 48\) on dim 0 .* shape \(32, 64\)"):
        src.get_slice(name, 0, 16, 48)


def test_bfloat16_weights_give_float32_logits_near_fp32(tmp_path):
    hf = make_hf_model("qwen3", tmp_path)
    model, config = load_model(tmp_path, dtype="bfloat16")
    assert config.dtype == torch.bfloat16 and model.embed_tokens.weight.dtype == torch.bfloat16
    assert config.kv_layout().dtype == torch.bfloat16
    ids = torch.randint(0, 256, (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(3))
    ours, ref = run_prefill_then_decode(model, config, ids), hf_logits(hf, ids)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)


def test_transformers4_config_json(tmp_path):
    """4.x layout: top-level rope_theta, rope_scaling with "type", torch_dtype, no head_dim."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 256,
        "vocab_size": 1000, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 4096,
        "eos_token_id": 7, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    config = ModelConfig.from_dir(tmp_path)
    assert (config.head_dim, config.num_kv_heads, config.rope.theta) == (16, 2, 1000000.0)
    assert (config.rope.rope_type, config.rope.original_max_position_embeddings) == ("yarn", 1024)
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm
    assert config.sliding_window is None and config.sliding_window_for(2) is None
    assert config.eos_token_ids == (9, 7) and config.bos_token_id == 1
    assert config.checkpoint_dtype == torch.bfloat16 and config.dtype == torch.float32
    layout = config.kv_layout(num_kv_heads=1, num_layers=2, first_layer=1)
    assert (layout.kind, layout.num_kv_heads, layout.num_layers, layout.first_layer, layout.head_dim) == \
        ("mha", 1, 2, 1, 16)


def test_resolve_dtype():
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("auto", torch.float16, device="cuda") == torch.float16
    assert resolve_dtype("auto", torch.float32, device="cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ModelConfigError, match="'int8'.*auto, float32, bfloat16, float16"):
        resolve_dtype("int8")


def test_unsupported_rope_type_is_named(tmp_path):
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], rope_parameters={
        "rope_theta": 10000.0, "rope_type": "longrope", "short_factor": [1.0] * 64,
        "long_factor": [2.0] * 64, "factor": 2.0}).save_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match="'longrope'.*default, linear, dynamic, llama3, yarn"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("heads, kv_heads", [(4, 3), (6, 4), (8, 0)])
def test_heads_that_do_not_group_are_refused_at_load(tmp_path, heads, kv_heads):
    """Before: 4 query heads over 3 KV heads loaded, then every request aborted in the attention kernel."""
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=96, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=16, intermediate_size=64,
                             num_hidden_layers=1, vocab_size=64).save_pretrained(tmp_path)
    if kv_heads == 0:           # 0 means "as many as the query heads" in HF configs: 8 / 8 loads
        assert ModelConfig.from_dir(tmp_path).num_kv_heads == heads
        return
    with pytest.raises(ModelConfigError, match=f"num_attention_heads {heads} .*num_key_value_heads {kv_heads}"):
        ModelConfig.from_dir(tmp_path)
