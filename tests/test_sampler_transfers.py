"""The sampler moves data between host and device twice per step, whatever the batch asks for (issue 38): the
per-row parameters go over in one packed copy and the results come back in one. Counted on CPU by wrapping every
way a tensor reaches the host (``tolist``, ``item``, ``int()``, ``float()``, ``bool()``, ``numpy``, ``cpu``) or is
made from host data (``torch.tensor``, ``from_numpy``, ``.to(device)``) while ``sample`` runs a batch that uses
every feature: on a GPU each of those is a transfer, most of them a full stream sync."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.runner.penalties import counts_from_ids
from pdserve.engine.runner.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 96
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=0.9, seed=4, top_k=5, logprobs=0), SamplingParams(temperature=1.1, top_p=0.8),
          SamplingParams(temperature=0.7, min_p=0.2, seed=9, logprobs=5), SamplingParams(temperature=1.0, top_k=40),
          SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 5.0, 7: -100.0}),
          SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.7, seed=1),
          SamplingParams(temperature=1.0, repetition_penalty=0.8, logit_bias={11: 2.0}, logprobs=2)] * 2
HISTORIES = [[1, 2, 3, 3, 50]] * len(PARAMS)
BANNED = [[0, 5] if i % 3 == 0 else [] for i in range(len(PARAMS))]


@pytest.fixture
def counted(monkeypatch):
    calls: Counter = Counter()

    def wrap(owner, name, key=None, when=lambda *a, **k: True):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            if when(*args, **kwargs):
                calls[key or name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counting)

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "numpy", "cpu", "__index__"):
        wrap(torch.Tensor, name, "to host")
    wrap(torch, "tensor", "from host")
    wrap(torch, "as_tensor", "from host")
    wrap(torch, "from_numpy", "from host")
    wrap(torch.Tensor, "to", "to device",
         when=lambda self, *a, **k: "device" in k or any(isinstance(x, (str, torch.device)) for x in a))
    return calls


def test_one_copy_each_way(counted):
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(0))
    penalised = [i for i, p in enumerate(PARAMS) if p.penalised]
    counts = counts_from_ids([[4, 4, 9]] * len(penalised), VOCAB)
    counted.clear()
    out = sample(logits, PARAMS, list(range(len(PARAMS))), HISTORIES, BANNED, counts)
    assert counted == {"to host": 1, "from host": 1, "to device": 1}, counted
    assert [len(r.top_logprobs) if r.top_logprobs is not None else None for r in out[:9]] == \
        [None, 3, 0, None, 5, None, None, None, 2]


def test_the_packed_path_gives_what_each_row_gives_alone():
    """Batched (one copy) == each row sampled on its own: the packing mixes no rows up."""
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(1))
    penalised = [i for i, p in enumerate(PARAMS) if p.penalised]
    counts = counts_from_ids([[4, 4, 9]] * len(penalised), VOCAB)
    draws = [3] * len(PARAMS)
    seeded = [i for i, p in enumerate(PARAMS) if p.seed is not None or p.greedy]
    batched = sample(logits, PARAMS, draws, HISTORIES, BANNED, counts)
    for i in seeded:
        row_counts = counts[penalised.index(i):penalised.index(i) + 1] if i in penalised else None
        alone = sample(logits[i:i + 1], PARAMS[i:i + 1], draws[i:i + 1], HISTORIES[i:i + 1], BANNED[i:i + 1],
                       row_counts)[0]
        assert alone.token_id == batched[i].token_id and alone.logprob == pytest.approx(batched[i].logprob)
        assert alone.top_logprobs == batched[i].top_logprobs or \
            [t for t, _ in alone.top_logprobs] == [t for t, _ in batched[i].top_logprobs]
