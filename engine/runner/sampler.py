"""Turn one step's last-position logits into one token per request.

Called by the model runner once per step, on the rank that holds the final logits:

    results = sample(logits, params, draws, histories, banned, counts)

``logits[i]`` belongs to the request whose ``SamplingParams`` is ``params[i]``;
``draws[i]`` is the number of draws that request made before (``seeded.py``: its next draw is a function of
``params.seed`` and that count; None counts as 0), read only when it has a seed -- unseeded rows draw from
torch's global RNG; ``histories[i]`` is its prompt +
output token ids (read only when ``repetition_penalty != 1``); ``banned[i]`` the token
ids it may not pick now (eos and stop ids before ``min_tokens``); ``counts`` the [M, V] counts of the
generated tokens of the rows with a presence or frequency penalty (``penalties.py``).

Order of the logits transforms (vLLM's): logit_bias -> repetition penalty (HF semantics, prompt + output)
-> presence / frequency penalties (output only) -> banned ids -> temperature -> top_k -> top_p -> min_p -> sample.

A seeded request makes exactly one draw per sampled token, so a node that continues a request another node
started (disaggregated decode) passes ``generator_draws(params, num_sampled)`` as its first draw index.
Greedy requests (``temperature`` below ``GREEDY_TEMPERATURE``, 1e-5, or ``top_k == 1``) take the
argmax after logit_bias and the penalties, like HF and vLLM. A batch that is all greedy without penalty
is one ``argmax`` over the batch: that is the hot path.

Logprobs are from the raw, unprocessed ``log_softmax`` of the logits (vLLM's
default ``raw_logprobs``), so a greedy and a sampled run report the same numbers, and neither
``min_tokens`` suppression, ``logit_bias`` nor the penalties change them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.runner.penalties import apply_logit_bias, apply_penalties
from pdserve.engine.runner.seeded import inverse_cdf, seeded_uniform
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float                                 # raw log_softmax of the chosen token
    top_logprobs: list[tuple[int, float]] | None   # None unless params.logprobs is set


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int | None],
           histories: list[list[int]] | None = None,
           banned: list[list[int]] | None = None, counts: torch.Tensor | None = None) -> list[SampleResult]:
    """Pick one token per row of ``logits`` ([N, V]); see the module docstring. ``logits`` is not modified."""
    n = logits.shape[0]
    if len(params) != n or len(draws) != n:
        raise ValueError(f"sample got {n} logit rows but {len(params)} params and {len(draws)} draw counts")
    logits = logits.float()                                  # [N, V]
    raw_logprobs = _raw_logprobs(logits, params)             # [N, V] or None
    processed = apply_logit_bias(logits, params)
    processed = apply_penalties(_apply_repetition_penalty(processed, params, histories), params, counts)
    processed = _ban(processed, logits, banned)
    token_ids = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(greedy_rows) == n:
        token_ids = processed.argmax(dim=-1)
    elif greedy_rows:
        rows = torch.tensor(greedy_rows, device=logits.device)
        token_ids[rows] = processed[rows].argmax(dim=-1)
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(processed[rows], [params[i] for i in random_rows])
        token_ids[rows] = _draw(probs, [params[i].seed for i in random_rows], [draws[i] for i in random_rows])
    return _results(logits, raw_logprobs, token_ids, params)


def _raw_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Full log_softmax [N, V] only when some request asked for top logprobs."""
    if any(p.logprobs for p in params):
        return torch.log_softmax(logits, dim=-1)
    return None


def _apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams],
                              histories: list[list[int]] | None) -> torch.Tensor:
    """HF semantics: a seen token's logit is divided by the penalty if > 0, else multiplied."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("repetition_penalty != 1 needs histories (prompt + output token ids)")
    out = logits.clone()
    for i in rows:
        if not histories[i]:
            continue
        seen = torch.tensor(sorted(set(histories[i])), dtype=torch.long, device=logits.device)
        score = out[i, seen]
        penalty = params[i].repetition_penalty
        out[i, seen] = torch.where(score < 0, score * penalty, score / penalty)
    return out


def _ban(processed: torch.Tensor, raw: torch.Tensor, banned: list[list[int]] | None) -> torch.Tensor:
    """-inf at each row's banned ids, on a copy when ``processed`` is still the raw logits. An id outside
    [0, V) cannot be sampled anyway, so it is not banned (a negative one would index from the end)."""
    if not banned or not any(banned):
        return processed
    out = processed.clone() if processed is raw else processed
    vocab = out.shape[1]
    for row, ids in enumerate(banned):
        ids = [t for t in ids if 0 <= t < vocab]
        if ids:
            out[row, ids] = float("-inf")
    return out


def generator_draws(params: SamplingParams, num_sampled: int) -> int:
    """Draws a request made for ``num_sampled`` tokens: one each when seeded and not greedy."""
    return num_sampled if params.seed is not None and not params.greedy else 0


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p over the sampled rows; returns probs [M, V]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        logits = _top_k(logits, torch.tensor(top_k, device=device))
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = _min_p(probs, torch.tensor([p.min_p for p in params], device=device))
    return probs


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits ([M, V], k: [M]); ties at the k-th value are kept."""
    largest = logits.topk(int(k.max()), dim=-1).values       # [M, max k]: cheaper than a full sort
    kth = largest.gather(1, (k - 1).unsqueeze(1))            # [M, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)       # ascending mass [M, V]
    drop = cum <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False                                      # the top token always stays
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p * the row's top probability."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _draw(probs: torch.Tensor, seeds: list[int | None], draws: list[int | None]) -> torch.Tensor:
    """One draw per row ([M, V] -> [M]) in one batched pass (``seeded.inverse_cdf``): a seeded row's uniform is
    its ``(seed, draw)`` one, the others' come from torch's global RNG (``--seed``)."""
    unseeded = iter(torch.rand(sum(s is None for s in seeds), dtype=torch.float64).tolist())
    uniforms = [next(unseeded) if seed is None else seeded_uniform(seed, draw or 0) for seed, draw in zip(seeds, draws)]
    return inverse_cdf(probs, uniforms)


def _results(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
             params: list[SamplingParams]) -> list[SampleResult]:
    """Chosen-token logprob for every row; top-k raw logprobs for rows that asked."""
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    else:
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    both = torch.stack((token_ids.to(torch.float64), chosen.to(torch.float64))).tolist()   # one device -> host copy
    ids, lps = [int(i) for i in both[0]], both[1]
    results = []
    for i, p in enumerate(params):
        results.append(SampleResult(ids[i], lps[i], _top(raw_logprobs, i, p.logprobs)))
    return results


def _top(raw_logprobs: torch.Tensor | None, row: int, k: int | None) -> list[tuple[int, float]] | None:
    if k is None:
        return None
    if k == 0 or raw_logprobs is None:
        return []
    values, indices = raw_logprobs[row].topk(min(k, raw_logprobs.shape[1]))
    return list(zip(indices.tolist(), values.tolist()))
