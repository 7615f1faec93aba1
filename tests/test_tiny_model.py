"""make_tiny_model: HF transformers reads what it writes, greedy decoding is not degenerate, same seed -> same bytes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from pdserve.engine.checkpoints.tiny_model import (ARCHS, ENDOFTEXT_ID, IM_END_ID, IM_START_ID, SPECIAL_TOKENS,
                                                   make_tiny_model, register)

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def _load(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(model_dir)


def _weight_names(model_dir):
    names = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_reads_config_and_weights(tiny_dirs, arch):
    config = transformers.AutoConfig.from_pretrained(tiny_dirs[arch])
    model, tokenizer = _load(tiny_dirs[arch])
    names = _weight_names(tiny_dirs[arch])
    assert config.architectures == [ARCHS[arch]] and type(model).__name__ == ARCHS[arch]
    assert set(model.state_dict()) - names <= {"lm_head.weight"}     # nothing left at its random init
    assert config.tie_word_embeddings == (arch in ("qwen2", "qwen3"))
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.1.self_attn.k_norm.weight" in names) == (arch == "qwen3")
    assert config.vocab_size >= len(tokenizer) == 512
    assert json.loads((tiny_dirs[arch] / "config.json").read_text())["rope_theta"] == config.rope_parameters["rope_theta"]
    if arch == "qwen3":   # like Qwen3-0.6B: heads * head_dim != hidden_size
        assert config.num_attention_heads * config.head_dim == 2 * config.hidden_size


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_greedy_generation_is_not_degenerate(tiny_dirs, arch):
    """Parity tests compare greedy ids with HF: the tokens must vary and the argmax must be clear."""
    model, tokenizer = _load(tiny_dirs[arch])
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=ENDOFTEXT_ID,
                         output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])              # [32, 2]
    margins = (top2[:, 0] - top2[:, 1]).sort().values
    print(arch, len(set(new)), "distinct tokens; smallest top-1 margins", margins[:3].tolist(), repr(tokenizer.decode(new)))
    assert len(new) == 32 and len(set(new)) >= 8, new
    assert margins[0] > 1e-3 and margins[16] > 0.1, margins


def test_chat_template_and_special_tokens(tiny_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert tokenizer.eos_token_id == IM_END_ID
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2 and tokenizer.decode(ids) == text
    generation = json.loads((tiny_dirs["llama"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID] and generation["bos_token_id"] == ENDOFTEXT_ID


def test_byte_level_tokenizer_round_trips_any_text(tiny_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])
    for text in ["The old sailor carefully painted the wooden bridge.", "naïve café, 東京 🙂\n\tx=1", ""]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    merged = tokenizer.encode(" the wooden bridge", add_special_tokens=False)
    assert len(merged) < len(" the wooden bridge".encode()) / 2    # trained merges, not raw bytes


def test_same_seed_gives_identical_bytes(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen3", seed=7)
    b = make_tiny_model(tmp_path / "b", "qwen3", seed=7)
    c = make_tiny_model(tmp_path / "c", "qwen3", seed=8)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_dirs):
    sharded = make_tiny_model(tmp_path / "sharded", "llama", shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"]) == _weight_names(tiny_dirs["llama"])
    ids = torch.tensor([[IM_START_ID, 40, 41, 300, 7]])
    single, _ = _load(tiny_dirs["llama"])
    split, _ = _load(sharded)
    with torch.no_grad():
        assert torch.equal(single(ids).logits, split(ids).logits)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
])
def test_rope_scaling_reaches_transformers(tmp_path, rope_scaling):
    model_dir = make_tiny_model(tmp_path / "m", "llama", rope_scaling=rope_scaling)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["rope_scaling"] == rope_scaling and raw["rope_theta"] == 10_000.0
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.rope_parameters == {**rope_scaling, "rope_theta": 10_000.0}
    model, _ = _load(model_dir)
    assert model.model.rotary_emb.rope_type == rope_scaling["rope_type"]
    plain, _ = _load(make_tiny_model(tmp_path / "plain", "llama"))
    ids = torch.arange(3, 403).unsqueeze(0)                                   # [1, 400], past 256 positions
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, plain(ids).logits)


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="arch='gpt2'"):
        make_tiny_model(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="shards=999"):
        make_tiny_model(tmp_path / "y", "llama", shards=999)


def test_cli_subcommand_writes_a_model(tmp_path):
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "cli"), "--arch", "mistral", "--seed", "3",
                              "--num-layers", "3", "--hidden-size", "32", "--shards", "2"])
    assert args.func(args) == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "cli")
    assert (config.architectures, config.num_hidden_layers, config.hidden_size) == (["MistralForCausalLM"], 3, 32)
    assert (tmp_path / "cli" / "model.safetensors.index.json").exists()
