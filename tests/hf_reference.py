"""HF transformers as the reference: greedy token ids on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation that never stops early (eos is just another token, like ignore_eos)."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                         eos_token_id=None, pad_token_id=0, num_beams=1)
    return out[0, len(prompt_ids):].tolist()


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()
