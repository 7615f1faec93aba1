"""What every tiny random checkpoint writes beside its config: weights (safetensors, HF layout) and tokenizer files.

Shared by ``tiny_model.py`` (Llama family) and ``tiny_deepseek.py`` (DeepSeek V2/V3), and ``download.py`` (the
tokenizer files of converted models). The weight scales make greedy decoding of a random model wander (no
single-token loops) with clear top-1 margins, because parity tests compare greedy token ids with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

EMBED_STD = 0.05    # embeddings (and lm_head): small, so a tied lm_head does not just echo the last token
PROJ_GAIN = 2.0     # projections: std = PROJ_GAIN / sqrt(fan_in), so each layer visibly moves the residual
NORM_STD = 0.1      # RMSNorm weights: 1 + N(0, 0.1) ...
LOGIT_STD = 5.0     # ... except the final norm, scaled so logits have std ~5 and clear top-1 margins


def save_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    """model.safetensors, or ``shards`` files plus model.safetensors.index.json (HF layout)."""
    names = list(weights)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards={shards} must be between 1 and the number of tensors ({len(names)})")
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, per, extra = {}, *divmod(len(names), shards)
    start = 0
    for i in range(shards):
        part = names[start:start + per + (i < extra)]
        start += len(part)
        filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(out / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_tokenizer_files(out: Path, tokenizer, *, chat_template: str, eos_token: str, bos_token: str | None,
                          pad_token: str | None, model_max_length: int, unk_token: str | None = None) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inline) + special_tokens_map.json.

    Also used by ``download.py``, so that every model pdserve writes has the same tokenizer layout.
    """
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
    added = {str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip,
                                    "rstrip": t.rstrip, "normalized": t.normalized, "single_word": t.single_word}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
        "added_tokens_decoder": added, "chat_template": chat_template})
    _write_json(out / "special_tokens_map.json", {k: v for k, v in specials.items() if v is not None})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
