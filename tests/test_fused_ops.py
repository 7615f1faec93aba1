"""The fused RMSNorm (+ residual add) and rotary kernels against their torch references, and their switch.

Like ``test_triton_kernels.py``: compiled on a GPU (``bench/gpu_check.sh`` sets TRITON_INTERPRET=0 there),
else on CPU in Triton's interpreter (this file sets TRITON_INTERPRET=1 unless the environment says otherwise).
float32 and float16 are held to the torch path's bits where the arithmetic allows it (the residual sum and
the rotary embedding: every rounding is the same; the norm: the float32 sum's order and the rsqrt's last bit
may differ, so a tolerance of a few float32 ulps, float16 one ulp). bfloat16 goes through float32 casts at a
bf16 tolerance: the interpreter truncates float32 -> bfloat16 where the GPU (and torch) round to nearest.
Odd widths, non-power-of-two head counts and strided views (the qkv output's q and k) exercise the masks.
Both kernels are also compiled for sm_90 (no GPU needed), and the rope's PTX is checked for FMA contraction.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed")

from pdserve.engine.models.rope import apply_rotary  # noqa: E402
from pdserve.kernels import fused_ops, triton_norm, triton_rope  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
NORM_TOL = {torch.float32: dict(rtol=4e-6, atol=2e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}   # 2 bf16 ulps at |x| ~ 8 (sums that cancel)
EXACT = {torch.float32: True, torch.float16: True, torch.bfloat16: not INTERPRETED}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def device() -> str:
    """Where the kernels run: ``cuda`` compiled, or ``cpu`` in the interpreter."""
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: a compiled launch needs a GPU")
    return DEVICE


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(device)


def _close(got: torch.Tensor, want: torch.Tensor, dtype, exact: bool = False) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact and EXACT[dtype]:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), **NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 7), (5, 33), (19, 100), (3, 256), (40, 8)])
def test_rms_norm_equals_the_torch_path(device, dtype, rows, n):
    x, w = _randn(rows, n, dtype=dtype, device=device), _randn(n, dtype=dtype, seed=1, device=device)
    before = x.clone()
    _close(triton_norm.rms_norm(x, w, 1e-5), fused_ops.rms_norm_ref(x, w, 1e-5), dtype)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 7), (6, 65), (17, 128)])
def test_fused_add_rms_norm_returns_the_norm_and_the_updated_residual(device, dtype, rows, n):
    x, r = _randn(rows, n, dtype=dtype, device=device), _randn(rows, n, dtype=dtype, seed=2, device=device)
    w = _randn(n, dtype=dtype, seed=1, device=device)
    inputs = (x.clone(), r.clone())
    y, s = triton_norm.rms_norm(x, w, 1e-6, r)
    y_ref, s_ref = fused_ops.rms_norm_ref(x, w, 1e-6, r)
    _close(s, s_ref, dtype, exact=True)                  # residual + x: one rounding, the same one
    _close(y, y_ref, dtype)
    assert torch.equal(x, inputs[0]) and torch.equal(r, inputs[1])    # out of place: the inputs stay


def test_rms_norm_reads_strided_rows_and_q_norm_heads(device):
    """x as columns of a wider tensor, and [T, H, D] q/k-norm input as a view of the qkv output."""
    wide = _randn(9, 50, device=device)
    w = _randn(20, seed=1, device=device)
    _close(triton_norm.rms_norm(wide[:, 5:25], w, 1e-6), fused_ops.rms_norm_ref(wide[:, 5:25], w, 1e-6),
           torch.float32)
    qkv = _randn(7, 5 * 12 + 2 * 2 * 12, seed=3, device=device)
    q = qkv[:, :60].view(7, 5, 12)                       # 5 heads of 12, row stride 108
    wq = _randn(12, seed=4, device=device)
    _close(triton_norm.rms_norm(q, wq, 1e-6), fused_ops.rms_norm_ref(q, wq, 1e-6), torch.float32)


def test_rms_norm_of_no_rows(device):
    x, w = torch.empty(0, 16, device=device), torch.ones(16, device=device)
    assert triton_norm.rms_norm(x, w, 1e-6).shape == (0, 16)
    y, s = triton_norm.rms_norm(x, w, 1e-6, x)
    assert y.shape == s.shape == (0, 16)


def _qkv(t, hq, hkv, d, dtype, device):
    """q [T, Hq, D], k, v [T, Hkv, D]: views of one qkv output, as ``Attention.project`` makes them."""
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=5, device=device)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _cos_sin(t, d, device, dtype=torch.float32):
    freqs = torch.arange(t).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, hq, hkv, d", [(1, 4, 2, 16), (6, 3, 1, 10), (13, 8, 8, 64), (5, 6, 2, 80)])
def test_rotary_qk_in_place_equals_the_torch_path(device, dtype, t, hq, hkv, d):
    qkv, q, k, v = _qkv(t, hq, hkv, d, dtype, device)
    cos, sin = _cos_sin(t, d, device)
    want_q, want_k, v_before = fused_ops.rotary_ref(q, cos, sin), fused_ops.rotary_ref(k, cos, sin), v.clone()
    triton_rope.rotary_qk(q, k, cos, sin)
    _close(q, want_q, dtype, exact=True)
    _close(k, want_k, dtype, exact=True)
    assert torch.equal(v, v_before)                      # v shares the qkv buffer: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_with_cos_sin_cast_once_has_the_same_bits(device, dtype):
    """cos/sin already in the activations' dtype (the model casts once per step) == float32 cos/sin."""
    _, q, k, _ = _qkv(9, 4, 2, 32, dtype, device)
    q2, k2 = q.clone(), k.clone()
    cos, sin = _cos_sin(9, 32, device)
    triton_rope.rotary_qk(q, k, cos, sin)
    triton_rope.rotary_qk(q2, k2, cos.to(dtype), sin.to(dtype))
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_reference_is_the_models_cpu_path(dtype):
    """The reference the kernel is held to is what ``apply_rotary`` gives on CPU today (C kernel for fp32)."""
    x = _randn(11, 3, 24, dtype=dtype)
    cos, sin = _cos_sin(11, 24, "cpu")
    assert torch.equal(fused_ops.rotary_ref(x, cos, sin), apply_rotary(x, cos, sin))


def test_rotary_of_no_tokens_and_bad_shapes(device):
    q, k = torch.empty(0, 4, 8, device=device), torch.empty(0, 2, 8, device=device)
    cos, sin = torch.empty(0, 8, device=device), torch.empty(0, 8, device=device)
    triton_rope.rotary_qk(q, k, cos, sin)
    with pytest.raises(ValueError, match="even D"):
        triton_rope.rotary_qk(torch.empty(2, 4, 7), torch.empty(2, 2, 7), torch.empty(2, 7), torch.empty(2, 7))


def test_the_switch(monkeypatch):
    """auto: CUDA tensors only; 0: never; 1: CPU tensors too, only under the interpreter."""
    x = torch.zeros(2, 4)
    for mode, want in (("auto", False), ("0", False), ("1", INTERPRETED)):
        monkeypatch.setattr(fused_ops, "NORM", mode)
        monkeypatch.setattr(fused_ops, "ROPE", mode)
        if mode == "1" and not INTERPRETED:
            with pytest.raises(ValueError, match="TRITON_INTERPRET"):
                fused_ops.norm_on(x)
            continue
        assert fused_ops.norm_on(x) is want and fused_ops.rope_on(x) is want
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="PDSERVE_FUSED_ROPE=1 on a CPU tensor"):
        fused_ops.rope_on(x)


def test_rows_the_kernel_cannot_take_go_to_torch(monkeypatch):
    """A strided last dim: ``fused_ops.rms_norm`` falls back to the reference."""
    x = _randn(4, 16)[:, ::2]
    w = _randn(8, seed=1)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))


def test_kernels_compile_for_hopper_and_the_rope_has_no_fma():
    """The interpreter misses compiled-mode errors and contraction: build both kernels for sm_90 with the wheel's
    ptxas; the rope kernel's PTX must hold no ``fma`` (each product rounded before the add, in every dtype)."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    code = "import test_fused_ops as t; t.compile_for_hopper()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=240)


def compile_for_hopper() -> None:
    """Compile the norm (plain, with the residual; bf16 and fp32) and the rope kernel (fp32, bf16, fp16) for
    sm_90, with the options their launches use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, pointer, consts, **options):
        sig = {a: "constexpr" if a in consts else "fp32" if a == "eps" else
               ("*fp32" if a in ("cos_ptr", "sin_ptr") else pointer) if a.endswith("_ptr") else "i32"
               for a in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)

    for pointer in ("*bf16", "*fp32"):
        for residual in (False, True):
            build(triton_norm._rms_norm_kernel, pointer, dict(HAS_RESIDUAL=residual, ROWS=1, BLOCK=2048),
                  num_warps=8)
        build(triton_norm._rms_norm_kernel, pointer, dict(HAS_RESIDUAL=False, ROWS=16, BLOCK=128), num_warps=8)
    for pointer in ("*fp32", "*bf16", "*fp16"):
        rope = build(triton_rope._rope_kernel, pointer, dict(HALF=32, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=32),
                     num_warps=4, enable_fp_fusion=False)
        assert "fma" not in rope.asm["ptx"], f"the {pointer} rope kernel contracts a product into an fma"
