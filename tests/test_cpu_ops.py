"""The C ops (kernels/cpu_ops.c) against their torch expressions, and the model layers that call them.

Rotary: the torch expression ``x * cos + cat(-x2, x1) * sin`` is what HF computes and what the engine ran
before; the C path gives the same float32 bits, for strided q/k views of the qkv output, head sizes with and
without a vector tail, empty and one-row steps, and inf/NaN/-0. RMSNorm and SiLU-and-mul: within a few ulp
of torch's (their sum order / exp differ), a row's bits independent of the other rows, and the layers fall
back to torch for what the C path does not take (bfloat16, 3-D q/k norms).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.models import rope
import torch.nn.functional as F

from pdserve.engine.models.layers import GatedMLP, RMSNorm
from pdserve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="cpu ops kernels not built here "
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
    assert same_bits(cpu_ops.rotary(x, cos, sin), torch_rope(x, cos, sin))


@pytest.mark.parametrize("D", [8, 64, 128])
def test_q_and_k_as_column_slices_of_the_qkv_output(D):
    T, H, HKV = 33, 4, 2
    qkv = torch.randn(T, (H + 2 * HKV) * D)
    q, k, _ = qkv.split((H * D, HKV * D, HKV * D), dim=-1)
    q, k = q.view(T, H, D), k.view(T, HKV, D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    for x in (q, k):
        assert not x.is_contiguous()
        assert same_bits(cpu_ops.rotary(x, cos, sin), torch_rope(x, cos, sin))


def test_special_values_round_like_torch():     # NaN where torch has NaN (its sign bit is not matched)
    x, cos, sin = torch.randn(4, 2, 16), torch.randn(4, 16), torch.randn(4, 16)
    x[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])
    x[1, 1, 9] = float("nan")
    cos[2, 0], sin[3, 15] = 0.0, -0.0
    got, want = cpu_ops.rotary(x, cos, sin), torch_rope(x, cos, sin)
    assert torch.equal(got.isnan(), want.isnan())
    assert same_bits(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_apply_rotary_takes_the_c_path_for_float32_and_torch_otherwise(monkeypatch):
    x, cos, sin = torch.randn(5, 3, 64), torch.randn(5, 64), torch.randn(5, 64)
    calls = []
    real = cpu_ops.rotary
    monkeypatch.setattr(cpu_ops, "rotary", lambda *a: calls.append(a) or real(*a))
    assert same_bits(rope.apply_rotary(x, cos, sin), torch_rope(x, cos, sin))
    assert len(calls) == 1
    xb = x.to(torch.bfloat16)
    out = rope.apply_rotary(xb, cos, sin)
    assert len(calls) == 1 and out.dtype == torch.bfloat16        # bfloat16 rounds per op: torch does it


def test_layouts_it_cannot_take_fall_back_to_torch():
    x, cos, sin = torch.randn(6, 4, 32), torch.randn(6, 32), torch.randn(6, 32)
    assert cpu_ops.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin) is None   # heads not contiguous
    assert cpu_ops.rotary(x, cos.t().contiguous().t(), sin) is None                            # strided cos
    assert cpu_ops.rotary(x, cos.double(), sin) is None
    assert same_bits(rope.apply_rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin),
                     torch_rope(x, cos, sin))


def torch_rms_norm(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@settings(max_examples=60, deadline=None)
@given(N=st.integers(0, 40), D=st.integers(1, 300), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**31 - 1))
def test_rms_norm_is_within_a_few_ulp_of_torch(N, D, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(N, D, generator=g) * scale, torch.randn(D, generator=g)
    got, want = cpu_ops.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)


@settings(max_examples=60, deadline=None)
@given(N=st.integers(0, 40), I=st.integers(1, 200), scale=st.sampled_from([0.1, 3.0, 20.0]),
       seed=st.integers(0, 2**31 - 1))
def test_silu_and_mul_is_within_a_few_ulp_of_torch(N, I, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(N, 2 * I, generator=g) * scale
    gate, up = gate_up.split(I, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=4e-6, atol=1e-35)


def test_silu_where_exp_of_minus_gate_nears_float_overflow():
    gate = torch.linspace(-89.5, -87.0, 4001)                     # exp(-g) overflows float past 88.72
    gate_up = torch.cat((gate, torch.ones_like(gate))).view(1, -1)
    want = F.silu(gate)
    got = cpu_ops.silu_and_mul(gate_up)[0]
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=4e-6, atol=0)


@pytest.mark.parametrize("D", [4096, 8192, 65536])
def test_rms_norm_stays_close_at_any_width(D):
    for x in (torch.full((2, D), 1 / 3), torch.rand(2, D) * 0.2 + 0.9):
        w = torch.ones(D)
        torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), rtol=4e-7, atol=0)


def test_zero_width_falls_back_to_torch():
    assert cpu_ops.rotary(torch.randn(4, 0, 8), torch.randn(4, 8), torch.randn(4, 8)) is None
    assert cpu_ops.rms_norm(torch.randn(3, 0), torch.randn(0), 1e-6) is None
    assert cpu_ops.silu_and_mul(torch.randn(3, 0)) is None
    assert rope.apply_rotary(torch.randn(4, 0, 8), torch.randn(4, 8), torch.randn(4, 8)).shape == (4, 0, 8)
    assert RMSNorm(0, 1e-6, torch.float32)(torch.randn(3, 0)).shape == (3, 0)


def test_silu_and_mul_special_values():
    gate_up = torch.tensor([[0.0, -0.0, float("inf"), float("nan"), -100.0, 100.0, 2.0, -2.0, 1.0],
                            [1.0] * 9], dtype=torch.float32).repeat_interleave(2, dim=1)[:, :18]
    got = cpu_ops.silu_and_mul(gate_up)
    gate, up = gate_up.split(9, dim=-1)
    want = F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), rtol=4e-6, atol=1e-35)


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(0)
    x, w, gu = torch.randn(33, 256, generator=g), torch.randn(256, generator=g), torch.randn(33, 256, generator=g)
    for n in (1, 2, 7, 33):
        assert same_bits(cpu_ops.rms_norm(x[:n], w, 1e-5), cpu_ops.rms_norm(x, w, 1e-5)[:n])
        assert same_bits(cpu_ops.silu_and_mul(gu[-n:]), cpu_ops.silu_and_mul(gu)[-n:])


def test_strided_rows_and_layer_dispatch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 512, generator=g)
    x = wide[:, 100:356]                                       # a column slice: rows 512 floats apart
    norm = RMSNorm(256, 1e-5, torch.float32)
    norm.weight.copy_(torch.randn(256, generator=g))
    assert same_bits(norm(x), cpu_ops.rms_norm(x.contiguous(), norm.weight, 1e-5))
    calls = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append(a) or real(*a))
    norm(x)
    norm(x.view(9, 2, 128)[:, :, :].contiguous().view(9, 2, 128)[..., :128].reshape(9, 256))
    assert len(calls) == 2
    norm_qk = RMSNorm(64, 1e-6, torch.float32)                 # q/k norms get [T, H, D]: torch's path
    norm_qk.weight.fill_(1.0)
    y = torch.randn(5, 3, 64, generator=g)
    torch.testing.assert_close(norm_qk(y), torch_rms_norm(y, norm_qk.weight, 1e-6), rtol=0, atol=0)
    assert len(calls) == 2
    bf = RMSNorm(256, 1e-5, torch.bfloat16)
    bf.weight.fill_(1.0)
    assert bf(wide[:, :256].bfloat16()).dtype == torch.bfloat16 and len(calls) == 2


def test_gated_mlp_uses_the_fused_pass_and_matches_torch():
    g = torch.Generator().manual_seed(2)
    mlp = GatedMLP(64, 48, False, torch.float32)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(17, 64, generator=g)
    gate, up = mlp.gate_up(x).split(48, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.down(F.silu(gate) * up), rtol=1e-5, atol=1e-6)


def _caches(num_blocks=6, bs=4, hkv=2, d=8, dtype=torch.float32):
    base = torch.randn(num_blocks, bs, hkv, d).to(dtype)
    return {"k": base.clone(), "v": (base + 1).clone()}, {"k": base.clone(), "v": (base + 1).clone()}


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 24), hkv=st.integers(1, 3), d=st.sampled_from([8, 16, 24]), pad=st.integers(0, 4),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**31 - 1))
def test_write_kv_writes_what_index_copy_writes(T, hkv, d, pad, slot_dtype, seed):
    """K a contiguous tensor (rotary's output), V a column slice of the qkv output; padding slots skipped."""
    from pdserve.kernels.reference import write_to_cache
    g = torch.Generator().manual_seed(seed)
    ours, ref = _caches(hkv=hkv, d=d)
    num_slots = ours["k"].shape[0] * ours["k"].shape[1]
    qkv = torch.randn(T, 3 * hkv * d, generator=g)
    k = qkv[:, hkv * d:2 * hkv * d].contiguous().view(T, hkv, d)
    v = qkv[:, 2 * hkv * d:].view(T, hkv, d)
    slots = torch.randperm(num_slots, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[:min(pad, T)]] = -1
    slots = slots.to(slot_dtype)
    assert cpu_ops.write_kv(k, v, ours, slots)
    write_to_cache(k, v, ref, slots)
    assert same_bits(ours["k"], ref["k"]) and same_bits(ours["v"], ref["v"])


def test_write_kv_refuses_a_slot_past_the_cache_and_writes_nothing():
    ours, ref = _caches()
    k = torch.randn(3, 2, 8)
    with pytest.raises(IndexError, match="past the KV cache's 24 slots"):
        cpu_ops.write_kv(k, k, ours, torch.tensor([0, 5, 24]))
    assert torch.equal(ours["k"], ref["k"]) and torch.equal(ours["v"], ref["v"])


def test_write_kv_leaves_what_it_cannot_take_to_torch():
    ours, _ = _caches(dtype=torch.bfloat16)
    k = torch.randn(2, 2, 8)
    assert not cpu_ops.write_kv(k, k, ours, torch.tensor([0, 1]))                 # a bfloat16 cache
    ours, _ = _caches()
    assert not cpu_ops.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, ours, torch.tensor([0, 1]))
    assert not cpu_ops.write_kv(k, k, ours, torch.tensor([0.0, 1.0]))              # float slots
    assert not cpu_ops.write_kv(k, k[:, :1], ours, torch.tensor([0, 1]))          # shapes differ


def test_write_kv_leaves_views_it_cannot_read_plainly_to_torch():
    """A lazily negated view (its memory holds -k), a ZeroTensor (no memory) and K/V that live inside the cache
    itself: torch's path, which reads them right or refuses them (a hostile review's reproductions)."""
    from pdserve.kernels.reference import write_to_cache
    slots = torch.tensor([1, 2])
    ours, ref = _caches()
    k = torch.arange(32, dtype=torch.float32).view(2, 2, 8)
    neg = torch._neg_view(k)
    assert neg.is_neg() and not cpu_ops.write_kv(neg, k, ours, slots)
    zero = torch._efficientzerotensor((2, 2, 8))
    assert not cpu_ops.write_kv(zero, k, ours, slots)
    inside = ours["k"].view(-1, 2, 8)[0:2]
    assert not cpu_ops.write_kv(inside, k, ours, slots)
    assert not cpu_ops.write_kv(k, ours["v"].view(-1, 2, 8)[3:5], ours, slots)
    write_to_cache(neg, k, ref, slots)
    assert torch.equal(ref["k"].view(-1, 2, 8)[1], -k[0])
    assert cpu_ops.rms_norm(torch._neg_view(torch.ones(2, 8)), torch.ones(8), 1e-6) is None
