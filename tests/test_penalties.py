"""OpenAI's sampling knobs in the sampler: logit_bias, presence_penalty, frequency_penalty (issue 37).

Against a plain torch reference on a small vocabulary: a batch whose rows have different knobs and
different output counts (greedy, seeded, unpenalised bystanders) samples exactly what the unpenalised
sampler samples from the reference-processed logits, with the same generators; logprobs stay raw. The
input batch's persistent counts equal a plain count of each row's output ids, also across row reuse.

Before: SamplingParams had no presence_penalty / frequency_penalty / logit_bias, the sampler no
``counts`` and the runner no ``penalties`` / ``output_counts`` modules.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from pdserve.engine.runner.output_counts import OutputCounts
from pdserve.engine.runner.penalties import apply_logit_bias, apply_penalties, counts_from_ids, penalised_rows
from pdserve.engine.runner.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
VOCAB = 16


def _reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """One row by hand, in vLLM's order: bias, repetition (prompt + output), presence / frequency (output)."""
    row = [float(x) for x in logits]
    for t, b in params.logit_bias:
        row[t] += b
    for t in set(prompt + outputs):
        r = params.repetition_penalty
        row[t] = row[t] * r if row[t] < 0 else row[t] / r
    for t, c in Counter(outputs).items():
        row[t] -= params.frequency_penalty * c + params.presence_penalty
    return torch.tensor(row)


ROWS = [   # (params, prompt, outputs)
    (SamplingParams(temperature=0.0, frequency_penalty=1.5), [1, 2], [3, 3, 3, 4]),
    (SamplingParams(temperature=0.0), [1, 2], [3, 3, 3, 4]),                             # bystander: same ids
    (SamplingParams(temperature=0.0, presence_penalty=-2.0, logit_bias={5: 7.5, "9": -100}), [5], [9, 9, 0]),
    (SamplingParams(temperature=1.0, seed=3, presence_penalty=0.7, frequency_penalty=-0.4), [0], [1, 1, 2, 15]),
    (SamplingParams(temperature=0.8, seed=4, logit_bias={2: 3.0, 15: -1.0}, repetition_penalty=1.3), [2, 7], [7]),
    (SamplingParams(temperature=1.0, seed=5, frequency_penalty=2.0, repetition_penalty=0.8), [4], []),
    (SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=2.0, logit_bias={1: 0.5}), [], [1] * 9),
]


def _batch(seed: int):
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0
    params = [p for p, _, _ in ROWS]
    histories = [prompt + outputs for _, prompt, outputs in ROWS]
    counts = counts_from_ids([ROWS[i][2] for i in penalised_rows(params)], VOCAB)
    return logits, params, histories, counts


def _gens(params: list[SamplingParams]) -> list[int]:
    """Each row's draw count: its first draw."""
    return [0] * len(params)


@pytest.mark.parametrize("seed", range(6))
def test_a_mixed_batch_samples_what_the_reference_logits_give(seed):
    logits, params, histories, counts = _batch(seed)
    reference = torch.stack([_reference(logits[i], *ROWS[i]) for i in range(len(ROWS))])
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed) for p in params]
    for _ in range(5):                        # several draws: each seeded generator advances the same way
        got = sample(logits, params, _gens(params), histories, counts=counts)
        want = sample(reference, plain, _gens(plain))
        assert [r.token_id for r in got] == [r.token_id for r in want]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [got[i].token_id for i in greedy] == [int(reference[i].argmax()) for i in greedy]


def test_the_processed_logits_equal_the_reference_and_the_input_is_untouched():
    logits, params, histories, counts = _batch(11)
    before = logits.clone()
    biased = apply_logit_bias(logits, params)
    penalised = apply_penalties(biased, params, counts)
    for i, (p, prompt, outputs) in enumerate(ROWS):
        if p.repetition_penalty == 1.0:
            torch.testing.assert_close(penalised[i], _reference(logits[i], p, prompt, outputs))
    assert torch.equal(logits, before)
    assert apply_logit_bias(logits, [SamplingParams()] * len(ROWS)) is logits          # nothing to do: no copy
    assert apply_penalties(logits, [SamplingParams()] * len(ROWS), None) is logits


def test_the_knobs_change_the_picks_they_should():
    """The batch is not trivially equal: each knob flips its row's greedy pick away from the raw argmax."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = 1.0                                          # token 3 leads every row by 1
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.6),      # 3 seen twice: -1.2
              SamplingParams(temperature=0.0, presence_penalty=1.1),       # 3 seen: -1.1
              SamplingParams(temperature=0.0, logit_bias={7: 1.5})]
    counts = counts_from_ids([[3, 3], [3]], VOCAB)
    got = [r.token_id for r in sample(logits, params, [None] * 3, counts=counts)]
    assert got == [0, 0, 7]


def test_logprobs_stay_the_raw_models():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logit_bias={4: 100.0}, logprobs=3),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=0)]
    out = sample(logits, params, [None, None], counts=counts_from_ids([[int(logits[1].argmax())] * 3], VOCAB))
    raw = torch.log_softmax(logits, dim=-1)
    assert out[0].token_id == 4 and out[0].logprob == pytest.approx(float(raw[0, 4]), abs=1e-6)
    assert [t for t, _ in out[0].top_logprobs] == raw[0].topk(3).indices.tolist()
    assert out[1].token_id != int(logits[1].argmax())
    assert out[1].logprob == pytest.approx(float(raw[1, out[1].token_id]), abs=1e-6)


def test_a_bias_past_the_vocabulary_is_skipped_and_missing_counts_are_an_error():
    logits = torch.randn(1, VOCAB)
    assert torch.equal(apply_logit_bias(logits, [SamplingParams(logit_bias={VOCAB: 50.0})]), logits)
    with pytest.raises(ValueError, match="output token counts of 1 rows x 16 tokens, got None"):
        sample(logits, [SamplingParams(presence_penalty=1.0)], [None])


def test_counts_from_ids_is_a_plain_count():
    outputs = [[3, 3, 1], [], [15, 0, 15, 15], [VOCAB, -1, 2]]             # out-of-range ids are skipped
    counts = counts_from_ids(outputs, VOCAB)
    for i, ids in enumerate(outputs):
        want = torch.zeros(VOCAB)
        for t, c in Counter(t for t in ids if 0 <= t < VOCAB).items():
            want[t] = c
        assert torch.equal(counts[i], want)


def test_persistent_counts_equal_the_output_ids_across_steps_reuse_and_growth():
    table = OutputCounts(torch.device("cpu"))
    outputs: dict[int, list[int]] = {0: [], 1: [], 5: []}
    rng = np.random.default_rng(0)
    for step in range(30):
        for row in outputs:
            new = rng.integers(0, VOCAB, size=int(rng.integers(1, 4) if step % 7 == 0 else 1))
            table.note(row, new)
            outputs[row] += new.tolist()
        if step == 10:                         # row 1 given back, taken by a new request: nothing carries over
            table.clear(1)
            outputs[1] = []
        if step == 20:                         # a row past the table's size
            outputs[9] = []
        if step % 3 == 0:
            rows = sorted(outputs)
            assert torch.equal(table.gather(rows, VOCAB), counts_from_ids([outputs[r] for r in rows], VOCAB))
    table.clear(5)
    table.note(5, np.array([2, 2]))
    assert table.gather([5], VOCAB)[0].tolist() == [0, 0, 2] + [0] * (VOCAB - 3)


def test_a_row_counted_in_a_step_is_cleared_after_it():
    """The table is made inside a step (inference mode); a finished request's row is cleared outside one
    (``ModelRunner.release``). Before the fix that raised, and the request's final output was lost."""
    table = OutputCounts(torch.device("cpu"))
    table.note(2, np.array([1, 1, 3]))
    with torch.inference_mode():
        assert table.gather([2], VOCAB)[0, 1] == 2
    table.clear(2)
    table.note(2, np.array([4]))
    with torch.inference_mode():
        assert table.gather([2], VOCAB)[0].tolist() == [0, 0, 0, 0, 1] + [0] * (VOCAB - 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_batch_samples_what_it_samples_on_the_cpu():
    """Device tensors end to end: the persistent counts on the GPU, logits there, CPU-seeded generators."""
    logits, params, histories, _ = _batch(5)
    rows = penalised_rows(params)
    table = OutputCounts(torch.device("cuda"))
    for row in rows:
        table.note(row, np.array(ROWS[row][2], np.int64))
    with torch.inference_mode():
        counts = table.gather(rows, VOCAB)
    assert torch.equal(counts.cpu(), counts_from_ids([ROWS[i][2] for i in rows], VOCAB))
    got = sample(logits.cuda(), params, _gens(params), histories, counts=counts)
    want = sample(logits, params, _gens(params), histories, counts=counts.cpu())
    assert [r.token_id for r in got] == [r.token_id for r in want]
