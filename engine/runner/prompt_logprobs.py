"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens before it.

Called by ``ModelRunner.execute`` for a step in which some request asks for them:

    plan = plan_prompt_rows(scheduled)              # None: nobody in the step asks (the usual case)
    hidden = <every row of the step>                # not only the sampled rows (no LogitRows, no graph replay)
    chunks = prompt_logprobs(model, hidden, plan)   # {request_id: (first prompt index, [PromptLogprob, ...])}

A request's chunk computing positions ``[s, s + n)`` gives, from the row of position ``p``, the logprob of prompt
token ``p + 1`` -- for ``p < P - 1`` only (the last prompt row predicts the first output token: that is sampling).
So a prompt split over several steps (chunked prefill) yields its entries chunk by chunk, in order; the output
assembler joins them and hands the whole list out with the request's first token. A request that asks for them
computes its whole prompt: the block manager and the KV connector give it no cached prefix (a cached prefix has
no logits), as vLLM does. Logprobs are the raw ``log_softmax`` of the fp32 logits, as the sampler's are; the
logits are computed ``ROWS_PER_SLICE`` rows at a time, so a 2048-token chunk never holds [2048, vocab] at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.outputs import PromptLogprob

ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptRows:
    rows: list[int]                          # flat rows of the step whose logits give prompt logprobs
    targets: list[int]                       # the prompt token each row predicts
    spans: list[tuple[str, int, int, int]]   # (request id, first prompt index, count, k) in row order


def plan_prompt_rows(scheduled) -> PromptRows | None:
    """``scheduled``: the step's ``ScheduledRequest``s in row order (as ``InputBatch.prepare`` lays them out)."""
    rows, targets, spans, start_row = [], [], [], 0
    for item in scheduled:
        req, start = item.request, start_row
        start_row += item.num_new_tokens
        if req.sampling_params.prompt_logprobs is None:
            continue
        first = req.num_computed_tokens                      # where the chunk starts (InputBatch.prepare's rule)
        end = min(first + item.num_new_tokens, req.num_prompt_tokens - 1)
        if end > first:
            rows += range(start, start + end - first)
            targets += req.prompt_token_ids[first + 1:end + 1]
            spans.append((req.request_id, first + 1, end - first, req.sampling_params.prompt_logprobs))
    return PromptRows(rows, targets, spans) if spans else None


def prompt_logprobs(model, hidden: torch.Tensor, plan: PromptRows) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """``hidden``: the step's hidden states, every row [T, D] -> each planned request's entries."""
    k = max(span[3] for span in plan.spans)
    rows = torch.tensor(plan.rows, device=hidden.device)
    targets = torch.tensor(plan.targets, device=hidden.device)
    columns: list[list] = [[], [], [], [], []]          # ids, logprobs, ranks, top ids, top logprobs
    for lo in range(0, len(plan.rows), ROWS_PER_SLICE):
        part = _slice(model, hidden[rows[lo:lo + ROWS_PER_SLICE]], targets[lo:lo + ROWS_PER_SLICE], k)
        for column, values in zip(columns, part):
            column += values
    out, at = {}, 0
    for request_id, first, count, want in plan.spans:
        out[request_id] = (first, [_entry(columns, i, want) for i in range(at, at + count)])
        at += count
    return out


def _slice(model, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, ...]:
    """One slice of rows: (token ids, logprobs, ranks, top ids, top logprobs) as host lists (one copy each)."""
    logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)        # [R, V]
    chosen = logprobs.gather(1, targets.unsqueeze(1))                                 # [R, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1) if k else None
    return (targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(),
            top.indices.tolist() if top is not None else [[]] * len(targets),
            top.values.tolist() if top is not None else [[]] * len(targets))


def _entry(columns: list[list], i: int, k: int) -> PromptLogprob:
    ids, lps, ranks, top_ids, top_lps = columns
    return PromptLogprob(ids[i], lps[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k])))
