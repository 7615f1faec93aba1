"""The Triton fused MoE (``kernels/triton_moe.py``) equals the per-expert loop (``moe_ops.loop_moe``).

Like ``test_triton_kernels.py``: compiled on a GPU (``bench/gpu_check.sh`` sets TRITON_INTERPRET=0 there), else on
CPU in Triton's interpreter (this file sets TRITON_INTERPRET=1 unless the environment says otherwise), tiny shapes.
Ragged routing: experts nobody picks, one expert picked by every token, widths that are not powers of two or
multiples of the tiles, a step of one token; each BLOCK_M the tile rule picks. The block layout the kernel walks
(``align_block_size``) is checked on its own.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from pdserve.kernels import dispatch, moe_ops  # noqa: E402
from pdserve.kernels.triton_moe import BLOCK_MS, fused_moe, moe_tiles  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def _runnable():
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: a compiled launch needs a GPU")


def _case(T, E, k, H, inter, dtype=torch.float32, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    if skew:        # every token picks expert 0 first, then k - 1 of experts 1..min(k, E - 1); the rest never
        hi = min(k, E - 1)
        ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(hi, generator=g)[:k - 1]])
                           for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    assert int(ids.max()) < E
    weights = torch.rand(T, k, generator=g)
    to = dict(device=DEVICE)
    return x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to), weights.to(**to), \
        ids.to(**to)


@pytest.mark.parametrize("T,E,k,H,inter,skew", [
    (1, 4, 2, 32, 16, False),          # a decode step of one token
    (5, 8, 2, 32, 24, False),          # most experts empty; I not a power of two
    (9, 4, 1, 48, 16, True),           # top-1, every token on expert 0; H not a multiple of BLOCK_K
    (37, 4, 2, 32, 16, False),         # mean 18.5 rows per expert: BLOCK_M 32
    (70, 2, 2, 16, 8, True),           # 140 rows on 2 experts: BLOCK_M 64, several M blocks per expert
])
def test_fused_moe_equals_the_per_expert_loop(T, E, k, H, inter, skew):
    x, w13, w2, weights, ids = _case(T, E, k, H, inter, skew=skew)
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_ops.loop_moe(x, w13, w2, weights, ids)
    assert got.shape == (T, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_tile_rule_reaches_every_block_m():
    assert [moe_tiles(rows, 4, torch.float32).block_m for rows in (4, 64, 65, 128, 129, 4096)] == \
        [16, 16, 32, 32, 64, 64]
    assert set(BLOCK_MS) == {16, 32, 64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_rounding(dtype):
    x, w13, w2, weights, ids = _case(11, 4, 2, 32, 16, dtype=dtype, seed=3)
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_ops.loop_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_dispatch_sends_the_triton_backend_to_the_kernel():
    x, w13, w2, weights, ids = _case(6, 4, 2, 32, 16, seed=5)
    torch.testing.assert_close(dispatch.fused_moe(x, w13, w2, weights, ids, backend="triton"),
                               moe_ops.loop_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_block_size_pads_each_expert_to_whole_blocks(block_m):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])
    rows, block_expert, num_rows = moe_ops.align_block_size(ids, 5, block_m)
    n = ids.numel()
    used = int(num_rows)
    assert used == 3 * block_m                           # experts 0, 2, 3 each fill one block; 1 and 4 none
    assert rows.numel() % block_m == 0 and rows.numel() >= used
    assert block_expert[:3].tolist() == [0, 2, 3] and (block_expert[3:] == -1).all()
    for b, e in enumerate(block_expert[:3].tolist()):
        block = rows[b * block_m:(b + 1) * block_m].tolist()
        real = [r for r in block if r < n]
        assert real == sorted(r for r in range(n) if ids.flatten()[r] == e)     # token order within an expert
        assert block[len(real):] == [n] * (block_m - len(real))                  # padding after
    assert (rows[used:] == n).all()


def test_start_up_warm_up_reaches_every_block_m():
    """``kernel_warmup.warm_moe``'s inputs: one per BLOCK_M the tile rule picks, valid routings of k experts."""
    from types import SimpleNamespace

    from pdserve.engine.runner.kernel_warmup import moe_warmup_inputs

    for E, k in ((8, 2), (128, 8), (64, 6), (4, 4)):
        module = SimpleNamespace(cfg=SimpleNamespace(num_experts=E, top_k=k), w13=torch.empty(E, 32, 16))
        picked = []
        for x, weights, ids in moe_warmup_inputs(module):
            assert x.shape == (ids.shape[0], 16) and weights.shape == ids.shape == (ids.shape[0], k)
            assert int(ids.max()) < E and all(len(set(row)) == k for row in ids.tolist())
            picked.append(moe_tiles(ids.numel(), E, torch.bfloat16).block_m)
        assert picked == list(BLOCK_MS), (E, k, picked)
