"""Sampler: greedy, seeded sampling, filters, raw logprobs, HF repetition penalty."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from dataclasses import replace

from pdserve.engine.runner.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
VOCAB = 64


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_greedy_batch_is_argmax_with_first_max_on_ties():
    logits = _logits(5)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0      # tie: the first index wins
    params = [SamplingParams(temperature=0.0)] * 5
    out = sample(logits, params, [None] * 5)
    assert [r.token_id for r in out] == logits.argmax(dim=-1).tolist()
    assert out[2].token_id == 7
    assert all(r.top_logprobs is None for r in out)


def test_top_k_one_equals_greedy_even_with_temperature():
    logits = _logits(4, seed=1)
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    top1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(4)], [0] * 4)
    assert [r.token_id for r in top1] == [r.token_id for r in greedy]


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    out = sample(logits, params, [None, 0, None, None])
    assert out[0].token_id == int(logits[0].argmax())
    assert out[2].token_id == int(logits[2].argmax())


def _draws(logits: torch.Tensor, params: SamplingParams, seed: int, steps: int) -> list[int]:
    seeded = replace(params, seed=seed)
    return [sample(logits, [seeded], [k])[0].token_id for k in range(steps)]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = _logits(1, seed=4) / 3.0                         # flat enough to vary
    params = SamplingParams(temperature=1.0, seed=11)
    first = _draws(logits, params, 11, 40)
    assert first == _draws(logits, params, 11, 40)
    assert first != _draws(logits, params, 12, 40)
    assert len(set(first)) > 1


def test_seeded_row_is_independent_of_its_batch_neighbours():
    logits = _logits(3, seed=5) / 3.0
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, seed=99)]
    for k in range(20):
        alone = sample(logits[1:2], params[1:2], [k])[0].token_id
        assert alone == sample(logits, params, [None, k, 3])[1].token_id
        assert alone == sample(logits[1:], params[1:], [k, 5])[0].token_id


def _allowed_counts(logits: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    rows = logits.expand(draws, VOCAB).contiguous()
    return {r.token_id for r in sample(rows, [replace(params, seed=1000 + i) for i in range(draws)], [0] * draws)}


def test_top_k_never_picks_outside_the_k_largest():
    logits = _logits(1, seed=6) / 3.0
    allowed = set(logits[0].topk(5).indices.tolist())
    picked = _allowed_counts(logits, SamplingParams(temperature=1.0, top_k=5))
    assert picked <= allowed and len(picked) > 1


def test_top_k_draws_from_exactly_k_tokens():
    """Mutation caught (issue 43): ``logits <= kth`` in ``_top_k`` -- the k-th largest was dropped, ``top_k=5``
    sampled from 4. Five nearly flat leaders (no ties), the rest far below: 400 seeded draws name all five."""
    logits = torch.full((1, VOCAB), -30.0)
    leaders = [3, 17, 29, 40, 63]
    logits[0, leaders] = torch.tensor([5.0, 4.99, 4.98, 4.97, 4.96])
    logits[0, 50] = 4.0                                          # the sixth largest: outside top_k=5
    assert _allowed_counts(logits, SamplingParams(temperature=1.0, top_k=5)) == set(leaders)
    assert _allowed_counts(logits, SamplingParams(temperature=1.0, top_k=6)) == set(leaders) | {50}


def test_top_p_never_picks_outside_the_nucleus():
    logits = _logits(1, seed=7) / 3.0
    probs, order = logits[0].softmax(-1).sort(descending=True)
    nucleus_size = int((probs.cumsum(-1) < 0.5).sum()) + 1    # smallest set reaching 0.5
    allowed = set(order[:nucleus_size].tolist())
    picked = _allowed_counts(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert picked <= allowed and len(picked) > 1


def test_min_p_never_picks_below_the_threshold():
    logits = _logits(1, seed=8) / 3.0
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    picked = _allowed_counts(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert picked <= allowed and len(picked) > 1


def test_logprobs_are_raw_log_softmax_regardless_of_temperature():
    logits = _logits(3, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.7, top_k=10, logprobs=3),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, [None, 0, None])
    reference = torch.log_softmax(logits, dim=-1)
    for row, result in enumerate(out):
        assert result.logprob == pytest.approx(float(reference[row, result.token_id]), abs=1e-5)
    top = reference[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top.indices.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert len(out[1].top_logprobs) == 3
    assert out[2].top_logprobs is None


def test_logprobs_zero_returns_only_the_chosen_token():
    out = sample(_logits(1), [SamplingParams(temperature=0.0, logprobs=0)], [None])
    assert out[0].top_logprobs == []


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float):
    logits = _logits(2, seed=10)
    history = [[3, 5, 5, 17, 40], [0, 63, 12]]
    processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for row in range(2):
        expected = processor(torch.tensor([history[row]]), logits[row:row + 1].clone())
        got = sample(logits[row:row + 1], [SamplingParams(temperature=0.0, repetition_penalty=penalty,
                                                          logprobs=0)], [None], [history[row]])
        assert got[0].token_id == int(expected.argmax())
    # The penalty must be what changes the pick: craft a row where it flips the argmax.
    flip = torch.zeros(1, VOCAB)
    flip[0, 4], flip[0, 9] = 2.0, 1.8
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3)]
    assert sample(flip, params, [None], [[4]])[0].token_id == 9
    assert sample(flip, [SamplingParams(temperature=0.0)], [None])[0].token_id == 4


def test_repetition_penalty_distribution_matches_transformers_for_sampling():
    logits = _logits(1, seed=12) / 2.0
    history = logits[0].topk(3).indices.tolist() + [int(logits[0].argmin())]
    processed = RepetitionPenaltyLogitsProcessor(penalty=2.0)(torch.tensor([history]), logits.clone())
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, seed=5)
    draws = 3000
    rows = logits.expand(draws, VOCAB).contiguous()
    out = sample(rows, [params] * draws, list(range(draws)), [history] * draws)   # one request's draws 0..2999
    freq = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=VOCAB) / draws
    assert torch.allclose(freq, processed[0].softmax(-1), atol=0.04)
    assert not torch.allclose(freq, logits[0].softmax(-1), atol=0.04)   # the penalty mattered


def test_repetition_penalty_without_history_is_an_error():
    with pytest.raises(ValueError, match="histories"):
        sample(_logits(1), [SamplingParams(repetition_penalty=1.2)], [None])
