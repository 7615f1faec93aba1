"""Tokenizer loading (HF ``tokenizer.json`` + ``tokenizer_config.json`` with its chat template).

Called by the engine, the HTTP server and the proxy, which must tokenize exactly like the nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.engine.text.chat_template import TemplateLimits, render_chat


def load_tokenizer(model_dir: str | Path):
    """``AutoTokenizer.from_pretrained(model_dir)``, without its model config where the choice does not need it."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
    return AutoTokenizer.from_pretrained(str(path), config=_light_config(path))


_READ_BY_AUTOTOKENIZER = {"tokenizer_class", "model_name"}    # config.json keys it would read: then the whole path


def _light_config(path: Path):
    """What ``AutoTokenizer`` reads of the model config (``model_type``, the path), as a bare ``PreTrainedConfig``,
    when ``tokenizer_config.json`` names its class and has no ``auto_map`` (remote code), and config.json has none
    of the other keys AutoTokenizer reads (``tokenizer_class``, ``model_name``): then the class chosen
    is the same, and transformers does not import the model family's config module (~1.5 s of start-up: rope
    utilities, torch.distributed.tensor) in every process that tokenizes. None otherwise: AutoTokenizer loads
    the real config. ``tests/test_tokenizer_load.py`` checks both ways give the same tokenizer."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
        model_type = model_config["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    declared = tokenizer_config.get("tokenizer_class") if isinstance(tokenizer_config, dict) else None
    if not declared or not isinstance(declared, str) or "auto_map" in tokenizer_config \
            or not isinstance(model_type, str) or _READ_BY_AUTOTOKENIZER & model_config.keys():
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type, config._name_or_path = model_type, str(path)
    return config


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        limits: TemplateLimits = TemplateLimits(), tools: list[dict] | None = None) -> list[int]:
    """Chat messages (and tools) -> prompt token ids: the template rendered to text (in the bounded sandbox of
    ``chat_template``; the text transformers renders), then encoded without extra special tokens (the
    template has them), as vLLM does. The node and the proxy both call this."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use /v1/completions")
    text = render_chat(tokenizer, messages, add_generation_prompt, limits, tools)
    return tokenizer.encode(text, add_special_tokens=False)


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry, as stored (byte-level
    BPE stores one character per byte, SentencePiece one per character; byte-fallback entries like
    ``<0x0A>`` only overestimate). A prompt longer than ``max_model_len * max_chars_per_token`` cannot
    fit in ``max_model_len`` tokens, unless the tokenizer's normalizer deletes characters or an unknown
    token swallows a run of them -- prompts nobody needs to send."""
    entries = list(tokenizer.get_vocab()) + [str(t) for t in tokenizer.all_special_tokens]
    return max(1, max(len(e) for e in entries))
