"""The C rotary embedding (kernels/cpu_rope.c) gives the torch expression's bits, and apply_rotary uses it.

The torch expression ``x * cos + cat(-x2, x1) * sin`` is what HF computes and what the engine ran before;
the C path must give the same float32 bits (the KV the store digests, greedy = HF), for strided q/k views
of the qkv output, head sizes with and without a vector tail, empty and one-row steps, and inf/NaN/-0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.models import rope
from pdserve.kernels import cpu_rope

pytestmark = pytest.mark.skipif(cpu_rope.load() is None, reason="cpu rotary kernel not built here "
                                "(needs x86-64 with AVX2/FMA/F16C and a C compiler)")


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@settings(max_examples=60, deadline=None)
@given(T=st.integers(0, 40), H=st.integers(1, 9), half=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_bits_equal_the_torch_expression(T, H, half, seed):
    D = 2 * half
    g = torch.Generator().manual_seed(seed)
    x, cos, sin = torch.randn(T, H, D, generator=g), torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    assert same_bits(cpu_rope.rotary(x, cos, sin), torch_rope(x, cos, sin))


@pytest.mark.parametrize("D", [8, 64, 128])
def test_q_and_k_as_column_slices_of_the_qkv_output(D):
    T, H, HKV = 33, 4, 2
    qkv = torch.randn(T, (H + 2 * HKV) * D)
    q, k, _ = qkv.split((H * D, HKV * D, HKV * D), dim=-1)
    q, k = q.view(T, H, D), k.view(T, HKV, D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    for x in (q, k):
        assert not x.is_contiguous()
        assert same_bits(cpu_rope.rotary(x, cos, sin), torch_rope(x, cos, sin))


def test_special_values_round_like_torch():
    x, cos, sin = torch.randn(4, 2, 16), torch.randn(4, 16), torch.randn(4, 16)
    x[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])
    x[1, 1, 9] = float("nan")
    cos[2, 0], sin[3, 15] = 0.0, -0.0
    got, want = cpu_rope.rotary(x, cos, sin), torch_rope(x, cos, sin)
    assert torch.equal(got.isnan(), want.isnan())
    assert same_bits(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_apply_rotary_takes_the_c_path_for_float32_and_torch_otherwise(monkeypatch):
    x, cos, sin = torch.randn(5, 3, 64), torch.randn(5, 64), torch.randn(5, 64)
    calls = []
    real = cpu_rope.rotary
    monkeypatch.setattr(cpu_rope, "rotary", lambda *a: calls.append(a) or real(*a))
    assert same_bits(rope.apply_rotary(x, cos, sin), torch_rope(x, cos, sin))
    assert len(calls) == 1
    xb = x.to(torch.bfloat16)
    out = rope.apply_rotary(xb, cos, sin)
    assert len(calls) == 1 and out.dtype == torch.bfloat16        # bfloat16 rounds per op: torch does it


def test_layouts_it_cannot_take_fall_back_to_torch():
    x, cos, sin = torch.randn(6, 4, 32), torch.randn(6, 32), torch.randn(6, 32)
    assert cpu_rope.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin) is None   # heads not contiguous
    assert cpu_rope.rotary(x, cos.t().contiguous().t(), sin) is None                            # strided cos
    assert cpu_rope.rotary(x, cos.double(), sin) is None
    assert same_bits(rope.apply_rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin),
                     torch_rope(x, cos, sin))
