"""Tokenizer loading (HF ``tokenizer.json`` + ``tokenizer_config.json`` with its chat template).

Called by the engine, the HTTP server and the proxy, which must tokenize exactly like the nodes.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.chat_template import TemplateLimits, render_chat


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
    return AutoTokenizer.from_pretrained(str(path))


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        limits: TemplateLimits = TemplateLimits()) -> list[int]:
    """Chat messages -> prompt token ids: the template rendered to text (in the bounded sandbox of
    ``chat_template``; the text transformers renders), then encoded without extra special tokens (the
    template has them), as vLLM does. The node and the proxy both call this."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use /v1/completions")
    text = render_chat(tokenizer, messages, add_generation_prompt, limits)
    return tokenizer.encode(text, add_special_tokens=False)


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry, as stored (byte-level
    BPE stores one character per byte, SentencePiece one per character; byte-fallback entries like
    ``<0x0A>`` only overestimate). A prompt longer than ``max_model_len * max_chars_per_token`` cannot
    fit in ``max_model_len`` tokens, unless the tokenizer's normalizer deletes characters or an unknown
    token swallows a run of them -- prompts nobody needs to send."""
    entries = list(tokenizer.get_vocab()) + [str(t) for t in tokenizer.all_special_tokens]
    return max(1, max(len(e) for e in entries))
