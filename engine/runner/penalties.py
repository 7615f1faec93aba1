"""OpenAI's sampling knobs on a batch of logits: ``logit_bias``, ``presence_penalty``, ``frequency_penalty``.

Called by the sampler (``sampler.sample``), each one vectorised over the batch and skipped when no row uses it:

    processed = add_bias(logits, rows, ids, values)           # one index_put over every row's (id, bias) pairs
    processed = subtract_penalties(processed, rows, presence, frequency, counts)   # counts: [M, V], rows' order

(the tensors come packed from ``sample_batch.SampleBatch``; ``apply_logit_bias`` / ``apply_penalties`` build
them from the parameters for one call)

Semantics (OpenAI's, as vLLM applies them): ``logits[t] += logit_bias[t]``; then, over the request's *generated*
tokens only (not the prompt), ``logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]``.
The sampler applies them in vLLM's order: logit_bias, repetition penalty (prompt + output), presence / frequency.
A bias id outside [0, V) is skipped (the HTTP edge refuses it; it cannot be sampled anyway). Both return a new
tensor and never write into ``logits`` (the raw logprobs are computed from it).

The counts come from the model runner: the persistent input batch keeps them per row (``output_counts.py``);
a step message on a tp/pp worker rank carries the ids and ``counts_from_ids`` counts them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pdserve.engine.sampling_params import SamplingParams


def penalised_rows(params: list[SamplingParams]) -> list[int]:
    """Rows whose request has a presence or frequency penalty: the rows ``counts`` holds, in this order."""
    return [i for i, p in enumerate(params) if p.penalised]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [N, V] plus each row's ``logit_bias``; ``logits`` itself when no row has one."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    arrays = [bias_arrays(params[i].logit_bias) for i in rows]
    ids = np.concatenate([a[0] for a in arrays])
    biases = np.concatenate([a[1] for a in arrays])
    row_ids = np.repeat(np.array(rows, np.int64), [len(a[0]) for a in arrays])
    keep = ids < logits.shape[1]
    device = logits.device
    return add_bias(logits, torch.from_numpy(row_ids[keep]).to(device), torch.from_numpy(ids[keep]).to(device),
                    torch.from_numpy(biases[keep]).to(device))


def add_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``logits`` plus ``values`` at (``rows``, ``ids``) (each pair once); ``logits`` itself when there is none."""
    if not rows.numel():
        return logits
    return logits.index_put((rows, ids), values.to(logits.dtype), accumulate=True)


@functools.lru_cache(maxsize=4096)
def bias_arrays(logit_bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """A request's (id, bias) pairs as two arrays, made once per distinct ``logit_bias`` (not once per step)."""
    return (np.array([t for t, _ in logit_bias], np.int64), np.array([b for _, b in logit_bias], np.float32))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    counts: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [N, V] less each penalised row's presence and frequency penalties; ``counts`` [M, V] holds the
    generated-token counts of the ``penalised_rows(params)``, in that order. ``logits`` itself when none is."""
    rows = penalised_rows(params)
    if not rows:
        return logits
    device = logits.device
    return subtract_penalties(logits, torch.tensor(rows, device=device),
                              torch.tensor([params[i].presence_penalty for i in rows], device=device),
                              torch.tensor([params[i].frequency_penalty for i in rows], device=device), counts)


def subtract_penalties(logits: torch.Tensor, rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                       counts: torch.Tensor | None) -> torch.Tensor:
    """``logits`` less ``frequency x count + presence x (count > 0)`` on ``rows`` ([M] each; ``counts`` [M, V]);
    ``logits`` itself when ``rows`` is empty."""
    if not rows.numel():
        return logits
    if counts is None or counts.shape != (rows.numel(), logits.shape[1]):
        got = None if counts is None else tuple(counts.shape)
        raise ValueError(f"presence / frequency penalties need the output token counts of {rows.numel()} rows "
                         f"x {logits.shape[1]} tokens, got {got}")
    dtype = logits.dtype
    counts = counts.to(dtype=dtype)                  # the runner keeps them on the logits' device
    presence, frequency = presence.to(dtype).unsqueeze(1), frequency.to(dtype).unsqueeze(1)
    penalised = logits.index_select(0, rows) - frequency * counts - presence * (counts > 0).to(dtype)
    return logits.index_copy(0, rows, penalised)


def counts_from_ids(outputs: list[list[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(outputs), vocab] float32: how often each id occurs in each list (ids outside [0, vocab) skipped).
    One scatter_add over the padded lists: the stateless way, for requests that hold no input-batch row."""
    return counts_plan_from_ids(outputs, vocab, torch.device(device)).on_device(torch.device(device))


def counts_plan_from_ids(outputs: list[list[int]], vocab: int, device: torch.device):
    """``counts_from_ids`` as a ``CountsPlan`` (``output_counts.py``): the padded ids travel in the sampler's one
    packed copy."""
    from pdserve.engine.runner.output_counts import CountsPlan

    m, width = len(outputs), max((len(ids) for ids in outputs), default=0)
    padded = np.full((m, width), vocab, dtype=np.int64)                       # column vocab: the pad
    for i, ids in enumerate(outputs):
        padded[i, :len(ids)] = ids
    padded[(padded < 0) | (padded > vocab)] = vocab

    def resolve(views: dict[str, torch.Tensor]) -> torch.Tensor:
        counts = torch.zeros(m, vocab + 1, dtype=torch.float32, device=device)
        if width:
            index = views["count_ids"].long().view(m, width)
            counts.scatter_add_(1, index, torch.ones(m, width, dtype=torch.float32, device=device))
        return counts[:, :vocab]                                               # [M, V]
    return CountsPlan({"count_ids": padded.reshape(-1)}, resolve)
