"""Tokenizer loading (HF ``tokenizer.json`` + ``tokenizer_config.json`` with its chat template).

Called by the engine, the HTTP server and (later) the proxy, which must tokenize exactly like the nodes.
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
    return AutoTokenizer.from_pretrained(str(path))


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Chat messages -> prompt token ids: the template rendered to text, then encoded without extra
    special tokens (the template has them), as vLLM does. The node and the proxy both call this."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
