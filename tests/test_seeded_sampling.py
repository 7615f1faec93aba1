"""Counter-based seeded sampling (``engine/runner/seeded.py``): the draws follow the distribution, never pick a
zero-probability token, and a row's token is the same alone, in any batch, and on a node that starts at draw k."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings, strategies as st

from pdserve.engine.runner.seeded import inverse_cdf, seeded_uniform


def test_uniforms_are_uniform_and_distinct():
    values = [seeded_uniform(seed, k) for seed in range(50) for k in range(200)]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)
    counts = torch.histc(torch.tensor(values), bins=20, min=0.0, max=1.0)
    expected = len(values) / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.0, chi2                 # 19 degrees of freedom: p < 0.001 beyond ~43.8


def test_draws_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.125, 0.0, 0.125]], dtype=torch.float32)
    n = 8000
    picked = inverse_cdf(probs.expand(n, 6).contiguous(), [seeded_uniform(42, k) for k in range(n)])
    freq = torch.bincount(picked, minlength=6).double() / n
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, probs[0].double(), atol=0.02), freq


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, allow_subnormal=False), min_size=1, max_size=40),
       st.floats(0.0, 1.0, exclude_max=True))
def test_never_a_zero_probability_token(weights, u):
    probs = torch.tensor([weights], dtype=torch.float32)
    assume(float(probs.sum()) > 0)                          # a row with some mass (as float32)
    token = int(inverse_cdf(probs, [u])[0])
    assert probs[0, token] > 0, (weights, u, token)


def test_a_row_is_independent_of_its_batch():
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    uniforms = [seeded_uniform(7, k) for k in range(5)]
    batched = inverse_cdf(probs, uniforms)
    alone = torch.cat([inverse_cdf(probs[i:i + 1], uniforms[i:i + 1]) for i in range(5)])
    assert torch.equal(batched, alone)
