"""Turn one step's last-position logits into one token per request.

Called by the model runner once per step, on the rank that holds the final logits:

    results = sample(logits, params, draws, histories, banned, counts)

``logits[i]`` belongs to the request whose ``SamplingParams`` is ``params[i]``;
``draws[i]`` is the number of draws that request made before (``seeded.py``: its next draw is a function of
``params.seed`` and that count; None counts as 0), read only when it has a seed -- unseeded rows draw from a
process-wide sequence keyed by torch's seed; ``histories[i]`` is its prompt +
output token ids (read only when ``repetition_penalty != 1``); ``banned[i]`` the token
ids it may not pick now (eos and stop ids before ``min_tokens``); ``counts`` the [M, V] counts of the
generated tokens of the rows with a presence or frequency penalty (``penalties.py``), or a ``CountsPlan`` of them
(``output_counts.py``: the model runner's, whose host arrays ride in the step's one packed copy).

Order of the logits transforms (vLLM's): logit_bias -> repetition penalty (HF semantics, prompt + output)
-> presence / frequency penalties (output only) -> banned ids -> temperature -> top_k -> top_p -> min_p -> sample.

A seeded request makes exactly one draw per sampled token, so a node that continues a request another node
started (disaggregated decode) passes ``generator_draws(params, num_sampled)`` as its first draw index.
Greedy requests (``temperature`` below ``GREEDY_TEMPERATURE``, 1e-5, or ``top_k == 1``) take the
argmax after logit_bias and the penalties, like HF and vLLM. A batch that is all greedy without penalty
is one ``argmax`` over the batch: that is the hot path.

Transfers (``sample_batch.py``): the per-row parameters go to the device in one packed copy, and the tokens, their
logprobs and every row's top logprobs (one batched ``topk``) come back in one; nothing in between waits for the
device.

Logprobs are from the raw, unprocessed ``log_softmax`` of the logits (vLLM's
default ``raw_logprobs``), so a greedy and a sampled run report the same numbers, and neither
``min_tokens`` suppression, ``logit_bias`` nor the penalties change them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.runner.output_counts import CountsPlan
from pdserve.engine.runner.penalties import add_bias, subtract_penalties
from pdserve.engine.runner.sample_batch import HostFacts, SampleBatch
from pdserve.engine.runner.seeded import inverse_cdf
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float                                 # raw log_softmax of the chosen token
    top_logprobs: list[tuple[int, float]] | None   # None unless params.logprobs is set


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int | None],
           histories: list[list[int]] | None = None,
           banned: list[list[int]] | None = None,
           counts: torch.Tensor | CountsPlan | None = None) -> list[SampleResult]:
    """Pick one token per row of ``logits`` ([N, V]); see the module docstring. ``logits`` is not modified."""
    n, vocab = logits.shape
    if len(params) != n or len(draws) != n:
        raise ValueError(f"sample got {n} logit rows but {len(params)} params and {len(draws)} draw counts")
    logits = logits.float()                                  # [N, V]
    if _plain_greedy(params, banned):                        # the hot path: nothing to send to the device
        return _results(logits, None, logits.argmax(dim=-1), params, None)
    plan = counts if isinstance(counts, CountsPlan) else None
    batch = SampleBatch.build(params, draws, histories, banned, vocab, logits.device,
                              plan.host if plan is not None else None)                 # one H2D copy
    if plan is not None:
        counts = plan.resolve(batch.extra)                                             # [M, V]
    host = batch.host
    raw_logprobs = torch.log_softmax(logits, dim=-1) if host.logprob_rows else None    # [N, V] or None
    processed = add_bias(logits, *batch.bias)
    processed = subtract_penalties(_repeat(processed, *batch.repeat), *batch.penalised, counts)
    processed = _ban(processed, logits, *batch.ban)
    if not host.random:
        token_ids = processed.argmax(dim=-1)
    else:
        token_ids = torch.empty(n, dtype=torch.long, device=logits.device)
        if host.greedy:
            token_ids[batch.greedy] = processed[batch.greedy].argmax(dim=-1)
        probs = _filtered_probs(processed[batch.random] if host.greedy else processed, batch)
        token_ids[batch.random] = inverse_cdf(probs, batch.uniform)
    return _results(logits, raw_logprobs, token_ids, params, batch)


def _plain_greedy(params: list[SamplingParams], banned: list[list[int]] | None) -> bool:
    return not (banned and any(banned)) and all(p.greedy and not p.logprobs and not p.logit_bias and not p.penalised
                                                and p.repetition_penalty == 1.0 for p in params)


def _repeat(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: a seen token's logit is divided by the penalty if > 0, else multiplied (each (row, token)
    pair once)."""
    if not rows.numel():
        return logits
    score = logits[rows, ids]
    return logits.index_put((rows, ids), torch.where(score < 0, score * penalty, score / penalty))


def _ban(processed: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-inf at each row's banned ids, on a copy when ``processed`` is still the raw logits."""
    if not rows.numel():
        return processed
    out = processed.clone() if processed is raw else processed
    out[rows, ids] = float("-inf")
    return out


def generator_draws(params: SamplingParams, num_sampled: int) -> int:
    """Draws a request made for ``num_sampled`` tokens: one each when seeded and not greedy."""
    return num_sampled if params.seed is not None and not params.greedy else 0


def _filtered_probs(logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p over the sampled rows; returns probs [M, V]."""
    host = batch.host
    logits = logits / batch.temperature.unsqueeze(1)
    if host.max_top_k:
        logits = _top_k(logits, batch.top_k, host.max_top_k)
    if host.any_top_p:
        logits = _top_p(logits, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if host.any_min_p:
        probs = _min_p(probs, batch.min_p)
    return probs


def _top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's k largest logits ([M, V], k: [M], 0: all); ties at the k-th value are kept. ``max_k``, the
    largest k, comes from the host: the device is never asked."""
    largest = logits.topk(max_k, dim=-1).values               # [M, max k]: cheaper than a full sort
    kth = largest.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))   # [M, 1]
    kth = torch.where(k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
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


def _results(logits: torch.Tensor, raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
             params: list[SamplingParams], batch: SampleBatch | None) -> list[SampleResult]:
    """Chosen-token logprob for every row, top-k raw logprobs for the rows that asked: one batched ``topk``,
    read back with the tokens in the step's one device -> host copy (``batch`` None: no row asked)."""
    host = batch.host if batch is not None else HostFacts([], [], 0, False, False, False, False)
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    else:
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    parts = [token_ids.to(torch.float64), chosen.to(torch.float64)]
    width = max(host.logprob_k, default=0)
    if width:
        values, indices = raw_logprobs[batch.logprob_rows].topk(width, dim=-1)    # [L, width]
        parts += [values.to(torch.float64).flatten(), indices.to(torch.float64).flatten()]
    flat = torch.cat(parts).tolist()                                              # the one device -> host copy
    n, tops = len(params), {}
    ids, lps = flat[:n], flat[n:2 * n]
    values, indices = flat[2 * n:2 * n + len(host.logprob_rows) * width], flat[2 * n + len(host.logprob_rows) * width:]
    for j, (row, k) in enumerate(zip(host.logprob_rows, host.logprob_k)):
        at = j * width
        tops[row] = [(int(t), v) for t, v in zip(indices[at:at + k], values[at:at + k])]
    return [SampleResult(int(ids[i]), lps[i], None if p.logprobs is None else tops.get(i, []))
            for i, p in enumerate(params)]
