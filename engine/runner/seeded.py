"""Seeded sampling without generator state: a request's k-th draw is a pure function of ``(seed, k)``.

Called by ``sampler._draw`` for every sampled (not greedy) row -- an unseeded row's uniform comes from torch's
global RNG instead:

    u = seeded_uniform(seed, k)                    # k: the draws this request made before (on any node)
    token_ids = inverse_cdf(probs, uniforms)       # one batched pass: cumsum + searchsorted, [M, V] -> [M]

``seeded_uniform`` is SplitMix64 (Steele, Lea and Flood, 2014) read as a counter-based generator: its k-th output
for a seed is ``mix(seed + (k + 1) * 0x9E3779B97F4A7C15)``, so any draw is computed directly -- a node that goes
on with a request another node started (disaggregated decode) starts at ``k = sampler_draws`` with no state to
replay, and nothing is kept per request but a counter. It runs in Python on exact integers (one per row, a few
hundred nanoseconds), so the uniform is the same bits on every machine and device; its top 53 bits make a double
in [0, 1).

``inverse_cdf`` turns one uniform per row into a token: the first index whose cumulative probability (float64)
exceeds ``u`` times the row's total -- the method ``torch.multinomial`` uses for one sample, without its
generator. The cumulative sum runs along each row on its own, so a row's token does not depend on its batch
neighbours. Before, each seeded row drew with its own ``torch.Generator`` (a CPU one: on a GPU every seeded row
went to the host and back), the others with one ``torch.multinomial``; seeded outputs changed with this scheme (the
same seed picks other tokens than it did with ``torch.multinomial``'s generator). On this box's CPU
(``devbench/seeded_bench.py``, vocabulary 49,152, one thread) a step of 1 / 16 / 64 / 256 seeded rows took
3.7 / 62 / 241 / 1,199 ms with the generators and 1.0 / 11 / 71 / 398 ms now; ``torch.multinomial`` over 256
unseeded rows took 1,237 ms.
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def seeded_uniform(seed: int, draw: int) -> float:
    """The ``draw``-th uniform in [0, 1) of ``seed`` (any int; taken mod 2^64)."""
    z = (seed + (draw + 1) * _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z >> 11) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, uniforms: list[float] | torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ([M, V], non-negative, each row with some mass) for ``uniforms`` ([M]):
    the first index whose cumulative mass passes ``u`` x the row's mass; never a zero-probability token."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)                                     # [M, V]
    if isinstance(uniforms, torch.Tensor):
        u = uniforms.to(torch.float64)                                   # already on the device (SampleBatch)
    else:
        u = torch.tensor(uniforms, dtype=torch.float64).to(probs.device)
    target = (u * cdf[:, -1]).unsqueeze(1)                                           # [M, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    empty = probs.gather(1, picked.unsqueeze(1)).squeeze(1) <= 0                     # rounding at the very end
    return torch.where(empty, probs.argmax(dim=-1), picked)
