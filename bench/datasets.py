"""Offline, fixed-seed workloads for ``pdserve bench serve`` (names and defaults follow vLLM's).

Called by ``serve`` (and ``sweep``) once per run, before any request is sent:

    requests = sample_requests(DatasetConfig(name="random", num_prompts=64, ...), tokenizer)

Every dataset is built in token-id space from ``numpy.random.default_rng(seed)`` and turned into
text with the model's tokenizer, so the same seed gives the same prompts on every server. The
server's usage ``prompt_tokens`` replaces ``prompt_len`` when the stream reports it, as in vLLM.

- ``random``: input/output lengths uniform in [len*(1-ratio), len*(1+ratio)], optional shared prefix
- ``prefix_repetition``: ``num_prefixes`` prefixes, each shared by num_prompts/num_prefixes requests
- ``sharegpt``: a ShareGPT-format JSON file (first human turn -> prompt, first reply -> output length)
- ``multi-round`` and ``long-doc``: see ``datasets_rounds``
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMES = ("random", "prefix_repetition", "sharegpt", "multi-round", "long-doc")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    round: int = 0                 # requests of round r start after every request of round r-1 ended


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


def sample_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    from pdserve.bench import datasets_rounds

    name = cfg.name.replace("-", "_")
    builders = {"random": random_requests, "prefix_repetition": prefix_repetition_requests,
                "sharegpt": sharegpt_requests, "multi_round": datasets_rounds.multi_round_requests,
                "long_doc": datasets_rounds.long_doc_requests}
    if name not in builders:
        raise ValueError(f"--dataset-name {cfg.name!r} is not one of {', '.join(NAMES)}")
    if cfg.path and name != "sharegpt":
        raise ValueError(f"--dataset-path is only for --dataset-name sharegpt, not {cfg.name!r}")
    return builders[name](cfg, tokenizer)


def length_range(length: int, ratio: float) -> tuple[int, int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio {ratio} must be in [0, 1)")
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def random_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    src = TokenSource(tokenizer, cfg.seed)
    in_lo, in_hi = length_range(cfg.random_input_len, cfg.random_range_ratio)
    out_lo, out_hi = length_range(cfg.random_output_len, cfg.random_range_ratio)
    in_lens = src.rng.integers(in_lo, in_hi + 1, size=cfg.num_prompts)
    out_lens = src.rng.integers(out_lo, out_hi + 1, size=cfg.num_prompts)
    prefix = src.tokens(cfg.random_prefix_len)
    return [src.request(prefix + src.tokens(int(n)), int(m)) for n, m in zip(in_lens, out_lens)]


def prefix_repetition_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    if cfg.prefix_repetition_num_prefixes < 1 or cfg.num_prompts % cfg.prefix_repetition_num_prefixes:
        raise ValueError(f"--num-prompts {cfg.num_prompts} must be a multiple of "
                         f"--prefix-repetition-num-prefixes {cfg.prefix_repetition_num_prefixes}")
    src = TokenSource(tokenizer, cfg.seed)
    per_prefix = cfg.num_prompts // cfg.prefix_repetition_num_prefixes
    out = []
    for _ in range(cfg.prefix_repetition_num_prefixes):
        prefix = src.tokens(cfg.prefix_repetition_prefix_len)
        out += [src.request(prefix + src.tokens(cfg.prefix_repetition_suffix_len), cfg.prefix_repetition_output_len)
                for _ in range(per_prefix)]
    order = src.rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}, ...]."""
    if not cfg.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    data = json.loads(Path(cfg.path).read_text())
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data if len(c.get("conversations", [])) >= 2]
    order = np.random.default_rng(cfg.seed).permutation(len(pairs))
    out: list[SampleRequest] = []
    for i in order:
        if len(out) == cfg.num_prompts:
            break
        prompt, reply = pairs[i]
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = cfg.sharegpt_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if _valid_sharegpt(n_in, n_out, fixed_output=cfg.sharegpt_output_len is not None):
            out.append(SampleRequest(prompt, n_in, n_out))
    if len(out) < cfg.num_prompts:
        raise ValueError(f"{cfg.path} has only {len(out)} usable conversations; --num-prompts is {cfg.num_prompts}")
    return out


def _valid_sharegpt(n_in: int, n_out: int, fixed_output: bool) -> bool:
    """vLLM's filter: prompt >= 4 and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048."""
    too_short = n_in < 4 or (not fixed_output and n_out < 4)
    return not too_short and n_in <= 1024 and n_in + n_out <= 2048
