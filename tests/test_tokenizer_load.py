"""``load_tokenizer`` (engine/text/tokenizer.py) skips the model config where AutoTokenizer's choice does not need it:
the tokenizer it returns is AutoTokenizer's own, class, ids, text and special tokens, for every tokenizer the
project ships or converts; and it really does not import the model family's config module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pdserve.engine.text.tokenizer import _light_config, load_tokenizer

TEXTS = ["Hello world! The quick brown fox", "\n\n  jumps  über 日本語 🦊", "<|im_start|>user\nhi<|im_end|> 123456",
         " leading space", ""]


def _fingerprint(tok) -> dict:
    return {"class": type(tok).__name__, "ids": [tok.encode(t) for t in TEXTS],
            "plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
            "text": [tok.decode(tok.encode(t)) for t in TEXTS], "eos": tok.eos_token_id, "bos": tok.bos_token_id,
            "pad": tok.pad_token_id, "special": sorted(map(str, tok.all_special_tokens)), "len": len(tok),
            "template": tok.chat_template, "vocab": tok.get_vocab()}


def test_the_tokenizer_is_autotokenizer_s_own(tiny_models, tiny_llama_metaspace, smollm2):
    for name, path in {**tiny_models, "metaspace": tiny_llama_metaspace, "smollm2": smollm2}.items():
        assert _light_config(path) is not None, name                 # the fast path is the one taken
        assert _fingerprint(load_tokenizer(path)) == _fingerprint(AutoTokenizer.from_pretrained(str(path))), name


CHANGES = [("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
           ("tokenizer_config.json", {"tokenizer_class": None}), ("tokenizer_config.json", {"tokenizer_class": ""}),
           ("config.json", {"tokenizer_class": "LlamaTokenizer"}), ("config.json", {"model_name": "phi3"})]


@pytest.mark.parametrize("file, change", CHANGES, ids=[f"{f}:{next(iter(c))}={next(iter(c.values()))}"
                                                       for f, c in CHANGES])
def test_what_the_bare_config_would_miss_takes_autotokenizer_s_whole_path(tiny_llama, tmp_path, file, change):
    for f in tiny_llama.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / file).read_text())
    config.update(change)
    (tmp_path / file).write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    assert _light_config(tmp_path) is None
    assert _fingerprint(load_tokenizer(tmp_path)) == _fingerprint(AutoTokenizer.from_pretrained(str(tmp_path)))


def test_a_dir_without_a_config_takes_the_whole_path(tmp_path):
    assert _light_config(tmp_path) is None


def test_loading_does_not_import_the_model_family_s_config(tiny_llama):
    code = ("import sys; from pdserve.engine.text.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print('transformers.models.llama.configuration_llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("model_type", [None, 7])
def test_a_config_without_a_model_type_string_takes_the_whole_path(tiny_llama, tmp_path, model_type):
    for f in tiny_llama.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _light_config(tmp_path) is None
