"""What every dataset of ``pdserve bench serve`` shares: its flags (``DatasetConfig``), the request it yields
(``SampleRequest``) and the fixed-seed source of token ids and their text (``TokenSource``).

Imported by ``datasets`` (random, prefix_repetition, sharegpt; ``sample_requests``, the entry point) and
``datasets_rounds`` (multi-round, long-doc), which ``datasets`` dispatches to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    round: int = 0                 # requests of round r start after every request of round r-1 ended
    session: int = -1              # multi-round --multi-round-history generated: the user (runner.py threads it)
    turn: str = ""                 # ... and the text this round adds after the previous round's answer


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    sharegpt_output_len: int | None = None
    multi_round_users: int = 8
    multi_round_rounds: int = 4
    multi_round_system_len: int = 256
    multi_round_question_len: int = 64
    multi_round_answer_len: int = 64
    multi_round_history: str = "synthetic"     # or "generated": the server's own answers (LMCache's multi-round QA)
    long_doc_num_docs: int = 4
    long_doc_len: int = 2048
    long_doc_question_len: int = 32
    long_doc_rounds: int = 2
    long_doc_output_len: int = 32


class TokenSource:
    """Random token ids and the ids -> text conversion, for one tokenizer and seed.

    Ids come from a pool of tokens that decode on their own to clean text (no special tokens, no
    partial UTF-8 bytes), so decoding a sequence and re-tokenizing it gives about the same count
    (merges across token boundaries can only shorten it) and the text keeps every part of it.
    """

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.ids = clean_token_ids(tokenizer)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choice(self.ids, size=n).tolist() if n > 0 else []

    def to_text(self, ids: list[int]) -> tuple[str, int]:
        """The text of ``ids`` and its token count when the server tokenizes it again."""
        text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))

    def request(self, ids: list[int], output_len: int, round_: int = 0) -> SampleRequest:
        text, n = self.to_text(ids)
        return SampleRequest(text, n, output_len, round_)


def clean_token_ids(tokenizer) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    keep = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if text.strip() and "\ufffd" not in text and text.isprintable():
            keep.append(i)
    if not keep:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no plain-text tokens")
    return np.array(keep, dtype=np.int64)
