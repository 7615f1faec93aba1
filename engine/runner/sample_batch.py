"""``SampleBatch``: a step's per-row sampling inputs, packed on the host and sent to the device in one copy.

Built by ``sampler.sample`` once per step:

    batch = SampleBatch.build(params, draws, histories, banned, vocab, device, extra)

Every per-row number the sampler needs -- which rows are greedy, temperature / top_p / min_p / top_k and the
uniform of each sampled row, the (row, id, bias) triples of ``logit_bias``, the (row, token) pairs of the
repetition penalty and of the banned ids, the penalised rows and their presence / frequency penalties, and the
``extra`` arrays of the caller (the output counts' rows and new ids: ``output_counts.CountsPlan``) -- is laid
out in one float64 array (ids and counts are exact in it: they are far below 2^53), pinned on CUDA and copied with
one non-blocking H2D; the fields are views of that one device tensor, cast where an index is needed. What the
host must know to choose the code path (any top_k, the largest k, which rows want logprobs) is read from the
``SamplingParams``, never from the device: no step waits for the device before its one D2H copy at the end.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.runner.penalties import bias_arrays
from pdserve.engine.runner.seeded import seeded_uniform
from pdserve.engine.sampling_params import SamplingParams

_UNSEEDED_SALT = 0x243F6A8885A308D3                  # pi's first 64 bits: unseeded rows' key is no request's seed
_unseeded_draws = itertools.count()                  # this process's unseeded draws (the sampler runs on one thread)


@dataclass
class SampleBatch:
    greedy: torch.Tensor            # [G] row indices
    random: torch.Tensor            # [R] row indices
    temperature: torch.Tensor       # [R] float32, the random rows' in their order; likewise the next four
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor             # [R] long, 0: no top_k
    uniform: torch.Tensor           # [R] float64 in [0, 1)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]     # rows, ids, values (float32)
    repeat: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # rows, ids, penalty per pair (float32)
    ban: tuple[torch.Tensor, torch.Tensor]                    # rows, ids
    penalised: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, presence, frequency (float32)
    logprob_rows: torch.Tensor      # rows asking for top logprobs
    host: "HostFacts"
    extra: dict[str, torch.Tensor] = field(default_factory=dict)   # the caller's ``extra`` arrays (float64 views)

    @classmethod
    def build(cls, params: list[SamplingParams], draws: list[int | None], histories: list[list[int]] | None,
              banned: list[list[int]] | None, vocab: int, device: torch.device,
              extra: dict[str, np.ndarray] | None = None) -> "SampleBatch":
        host = HostFacts.of(params, vocab)
        parts = _Parts()
        parts.add("greedy", host.greedy)
        parts.add("random", host.random)
        parts.add("logprob_rows", host.logprob_rows)
        rand = [params[i] for i in host.random]
        parts.add("temperature", [p.temperature for p in rand])
        parts.add("top_p", [p.top_p for p in rand])
        parts.add("min_p", [p.min_p for p in rand])
        parts.add("top_k", [p.top_k if 0 < p.top_k < vocab else 0 for p in rand])
        parts.add("uniform", _uniforms(params, draws, host.random))
        _add_bias(parts, params, vocab)
        _add_repeat(parts, params, histories, vocab)
        host.any_ban = _add_ban(parts, banned, vocab) > 0
        pen = [i for i, p in enumerate(params) if p.penalised]
        parts.add("pen_rows", pen)
        parts.add("presence", [params[i].presence_penalty for i in pen])
        parts.add("frequency", [params[i].frequency_penalty for i in pen])
        for name, values in (extra or {}).items():
            parts.add(name, values)
        v = parts.to_device(device)
        f32, long = torch.float32, torch.long
        return cls(v["greedy"].to(long), v["random"].to(long), v["temperature"].to(f32), v["top_p"].to(f32),
                   v["min_p"].to(f32), v["top_k"].to(long), v["uniform"],
                   (v["bias_rows"].to(long), v["bias_ids"].to(long), v["bias_values"].to(f32)),
                   (v["rep_rows"].to(long), v["rep_ids"].to(long), v["rep_penalty"].to(f32)),
                   (v["ban_rows"].to(long), v["ban_ids"].to(long)),
                   (v["pen_rows"].to(long), v["presence"].to(f32), v["frequency"].to(f32)),
                   v["logprob_rows"].to(long), host, {name: v[name] for name in extra or {}})


@dataclass
class HostFacts:
    """What the host decides from the parameters alone."""
    greedy: list[int]
    random: list[int]
    max_top_k: int                   # the largest top_k among the random rows (0: none)
    any_top_p: bool
    any_min_p: bool
    any_bias: bool
    any_repeat: bool
    any_ban: bool = False
    logprob_rows: list[int] = field(default_factory=list)     # rows asking for top logprobs (k > 0)
    logprob_k: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int) -> "HostFacts":
        random = [i for i, p in enumerate(params) if not p.greedy]
        ks = [params[i].top_k for i in random if 0 < params[i].top_k < vocab]
        rows = [i for i, p in enumerate(params) if p.logprobs]
        return cls([i for i, p in enumerate(params) if p.greedy], random, max(ks, default=0),
                   any(params[i].top_p < 1.0 for i in random), any(params[i].min_p > 0.0 for i in random),
                   any(p.logit_bias for p in params), any(p.repetition_penalty != 1.0 for p in params),
                   logprob_rows=rows, logprob_k=[min(params[i].logprobs, vocab) for i in rows])


class _Parts:
    """Named float64 segments of one host array."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrays: list[np.ndarray] = []

    def add(self, name: str, values) -> None:
        self.names.append(name)
        self.arrays.append(np.asarray(values, dtype=np.float64).reshape(-1))

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        host = torch.from_numpy(np.concatenate(self.arrays)) if self.arrays else torch.empty(0, dtype=torch.float64)
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        out, at = {}, 0
        for name, array in zip(self.names, self.arrays):
            out[name], at = packed[at:at + len(array)], at + len(array)
        return out


def _uniforms(params: list[SamplingParams], draws: list[int | None], rows: list[int]) -> list[float]:
    """Each sampled row's uniform: its ``(seed, draw)`` one; an unseeded row's is the next of this process's own
    sequence, keyed by torch's seed (``--seed``; salted, so that it is no request's ``seed``)."""
    out = []
    for i in rows:
        seed = params[i].seed
        out.append(seeded_uniform(seed, draws[i] or 0) if seed is not None
                   else seeded_uniform(torch.initial_seed() ^ _UNSEEDED_SALT, next(_unseeded_draws)))
    return out


def _add_bias(parts: _Parts, params: list[SamplingParams], vocab: int) -> None:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    arrays = [bias_arrays(params[i].logit_bias) for i in rows]
    ids = np.concatenate([a[0] for a in arrays]) if arrays else np.empty(0, np.int64)
    values = np.concatenate([a[1] for a in arrays]) if arrays else np.empty(0, np.float32)
    row_ids = np.repeat(np.array(rows, np.int64), [len(a[0]) for a in arrays])
    keep = ids < vocab                                   # an id past the vocabulary cannot be sampled anyway
    parts.add("bias_rows", row_ids[keep])
    parts.add("bias_ids", ids[keep])
    parts.add("bias_values", values[keep])


def _add_repeat(parts: _Parts, params: list[SamplingParams], histories: list[list[int]] | None, vocab: int) -> None:
    """(row, token) once per distinct token of each penalised row's prompt + output (HF's semantics)."""
    rows, ids, penalty = [], [], []
    for i, p in enumerate(params):
        if p.repetition_penalty == 1.0:
            continue
        if histories is None:
            raise ValueError("repetition_penalty != 1 needs histories (prompt + output token ids)")
        seen = np.unique(np.asarray(histories[i], dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab)]
        rows.append(np.full(len(seen), i, np.int64))
        ids.append(seen)
        penalty.append(np.full(len(seen), p.repetition_penalty))
    parts.add("rep_rows", np.concatenate(rows) if rows else [])
    parts.add("rep_ids", np.concatenate(ids) if ids else [])
    parts.add("rep_penalty", np.concatenate(penalty) if penalty else [])


def _add_ban(parts: _Parts, banned: list[list[int]] | None, vocab: int) -> int:
    """(row, id) per banned id in [0, V) (one outside cannot be sampled anyway; a negative one would index from
    the end)."""
    pairs = [(row, t) for row, ids in enumerate(banned or ()) for t in ids if 0 <= t < vocab]
    parts.add("ban_rows", [r for r, _ in pairs])
    parts.add("ban_ids", [t for _, t in pairs])
    return len(pairs)
