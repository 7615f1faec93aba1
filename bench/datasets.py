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
from pathlib import Path

import numpy as np

from pdserve.bench.dataset_base import DatasetConfig, SampleRequest, TokenSource
from pdserve.bench.datasets_rounds import long_doc_requests, multi_round_requests

NAMES = ("random", "prefix_repetition", "sharegpt", "multi-round", "long-doc")


def sample_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    name = cfg.name.replace("-", "_")
    builders = {"random": random_requests, "prefix_repetition": prefix_repetition_requests,
                "sharegpt": sharegpt_requests, "multi_round": multi_round_requests,
                "long_doc": long_doc_requests}
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
