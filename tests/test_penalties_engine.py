"""logit_bias and the presence / frequency penalties through the engine (``LLM``, tiny llama, vocabulary 512).

- a +100 bias forces its token (greedy and seeded), a -100 bias bans it (the runner-up is picked instead);
  the logprobs stay the model's raw ones;
- a frequency / presence penalty follows its definition step by step: each generated token is the argmax of
  raw logprob + bias - frequency * count - presence * seen over the tokens generated before it, where the raw
  logprobs come from the same prefix fed as a prompt (a token pushed up by a bias then stops repeating);
- penalised requests preempted and recomputed (their rows rebuilt from scratch) give the tokens they give alone
  (negative penalties: the outputs depend on their counts);
- a bias id past the vocabulary is refused by name.

Before: SamplingParams took none of these knobs (TypeError), the HTTP edge refused them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from pdserve.engine import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8]
FAR = 300                        # a token far down the raw ranking
STEPS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama))
    yield engine
    engine.shutdown()


def _greedy(**knobs) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **knobs)


def test_a_plus_100_bias_forces_its_token_and_logprobs_stay_raw(llm):
    [plain] = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    forced = llm.generate([PROMPT] * 2, [_greedy(logit_bias={FAR: 100.0}, logprobs=5),
                                          SamplingParams(max_tokens=STEPS, temperature=1.0, seed=9, ignore_eos=True,
                                                         logit_bias={str(FAR): 100})])
    assert [o.token_ids for o in forced] == [[FAR] * STEPS] * 2
    first = forced[0].logprobs[0]
    want = plain.logprobs[0].top_logprobs                                              # the raw top 5
    assert [t for t, _ in first.top_logprobs] == [t for t, _ in want]
    assert [lp for _, lp in first.top_logprobs] == pytest.approx([lp for _, lp in want], abs=1e-5)
    assert FAR not in [t for t, _ in first.top_logprobs] and first.logprob < first.top_logprobs[-1][1]


def test_a_minus_100_bias_bans_its_token_and_the_runner_up_wins(llm):
    [plain] = llm.generate([PROMPT], _greedy(logprobs=2))
    top, runner_up = [t for t, _ in plain.logprobs[0].top_logprobs]
    [banned] = llm.generate([PROMPT], _greedy(logit_bias={plain.token_ids[0]: -100.0}))
    assert banned.token_ids[0] == runner_up != top == plain.token_ids[0]
    assert plain.token_ids[0] not in banned.token_ids
    [all_banned] = llm.generate([PROMPT], _greedy(logit_bias={t: -100.0 for t in plain.token_ids}))
    assert not set(all_banned.token_ids) & set(plain.token_ids)


def _reference_pick(llm, pushed: int, bias: float, frequency: float, presence: float,
                    out: list[int]) -> list[list[int]]:
    """For each k, what the definition picks after out[:k]: the raw logprobs of prompt + out[:k] (top 20, and
    ``pushed``'s own, read as the chosen token of a request that a +100 bias forces to it), then the knobs.
    A token outside those cannot win: it is below the top 20, at least 8 of which no penalty lowered."""
    probes = llm.generate([PROMPT + out[:k] for k in range(len(out))],
                          SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, logit_bias={pushed: 100.0}))
    picks = []
    for k, probe in enumerate(probes):
        result = probe.logprobs[0]
        assert result.token_id == pushed
        raw = dict(result.top_logprobs) | {pushed: result.logprob}
        counts = Counter(out[:k])
        score = {t: lp + (bias if t == pushed else 0.0) - frequency * counts[t] - presence * (counts[t] > 0)
                 for t, lp in raw.items()}
        best = max(score.values())
        picks.append([t for t, s in score.items() if s > best - 1e-3])   # near-ties: either is right
    return picks


@pytest.mark.parametrize("frequency, presence", [(2.0, 0.0), (0.0, 2.0), (0.7, 1.3)])
def test_penalties_follow_their_definition_and_stop_the_repeats(llm, frequency, presence):
    """The greedy first token, pushed by a bias, repeats; with a penalty it stops once its count costs more."""
    bias = 6.0
    pushed = llm.generate([PROMPT], _greedy())[0].token_ids[0]
    [repeated] = llm.generate([PROMPT], _greedy(logit_bias={pushed: bias}))
    assert Counter(repeated.token_ids)[pushed] >= STEPS - 2, repeated.token_ids      # the bias makes it repeat
    [out] = llm.generate([PROMPT], _greedy(logit_bias={pushed: bias}, frequency_penalty=frequency,
                                           presence_penalty=presence))
    assert 1 <= Counter(out.token_ids)[pushed] <= STEPS // 2, out.token_ids               # ... and no longer
    picks = _reference_pick(llm, pushed, bias, frequency, presence, out.token_ids)
    for k, (got, allowed) in enumerate(zip(out.token_ids, picks)):
        assert got in allowed, f"step {k}: picked {got}, the definition picks {allowed}"


def test_a_negative_frequency_penalty_makes_the_first_token_repeat(llm):
    [plain] = llm.generate([PROMPT], _greedy())
    [out] = llm.generate([PROMPT], _greedy(frequency_penalty=-2.0, presence_penalty=-2.0))
    assert out.token_ids[0] == plain.token_ids[0]
    assert Counter(out.token_ids).most_common(1)[0][1] > Counter(plain.token_ids).most_common(1)[0][1]


def test_penalised_requests_preempted_and_recomputed_keep_their_tokens(tiny_llama, llm):
    prompts = [[(7 * i + 13 * j) % 500 + 1 for j in range(40)] for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True,
                             frequency_penalty=-2.0 + 0.3 * i, presence_penalty=-0.5, logit_bias={FAR: 6.0})
              for i in range(6)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    unpenalised = [llm.generate([p], replace(sp, frequency_penalty=0.0, presence_penalty=0.0))[0].token_ids
                   for p, sp in zip(prompts, params)]
    assert sum(a != b for a, b in zip(alone, unpenalised)) >= 4                # the counts matter
    # 24 blocks of 8 tokens = 192 slots, while the batch wants 6 x 64 = 384: requests get preempted.
    tight = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=24, max_model_len=128).engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        tight.add_request(str(i), p, sp)
    tokens, requests = {str(i): [] for i in range(6)}, {}
    while tight.has_unfinished():
        for delta in tight.step():
            tokens[delta.request_id] += delta.new_token_ids
        requests |= {r.request_id: r for r in (*tight.scheduler.running, *tight.scheduler.waiting)}
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert [tokens[str(i)] for i in range(6)] == alone
    tight.block_manager.check_integrity()


def test_a_bias_id_past_the_vocabulary_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="logit_bias token id 512 is out of range; the vocabulary has 512 tokens"):
        llm.generate([PROMPT], _greedy(logit_bias={3: 1.0, 512: 1.0}))
    assert llm.generate([PROMPT], _greedy())[0].token_ids                     # nothing was left queued
