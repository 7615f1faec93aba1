"""The model's CUDA path -- residual adds fused into the next RMSNorm, RoPE in place on q and k -- on the CPU.

``PDSERVE_FUSED_NORM`` / ``PDSERVE_FUSED_ROPE`` = 1 (here ``fused_ops.NORM`` / ``ROPE``, set per test) send CPU
tensors through the Triton kernels in the interpreter: the code a CUDA step runs (``LlamaForCausalLM.
_layers_fused``, ``DecoderLayer.forward_fused``, ``RMSNorm.add_norm``, ``apply_rotary_qk``), checked against
the default CPU path (the C RMSNorm and rotary, which equal HF): logits to float32 rounding on tiny models
(with q/k norm: qwen3), pipeline stages, the rows-only last layer, and the engine's greedy tokens with the
Triton attention backend as well (the whole CUDA path, interpreted). With the switches at ``auto`` the CPU
never reaches a kernel.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from hf_reference import hf_greedy, hf_model, random_prompt  # noqa: E402
from test_logit_rows import _run as run_logit_rows  # noqa: E402
from test_models import BLOCK_SIZE, BLOCK_TABLE, PROMPT_LEN, make_hf_model, run_prefill_then_decode  # noqa: E402

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoints.tiny_model import make_tiny_model  # noqa: E402
from pdserve.engine.models.loader import load_model  # noqa: E402
from pdserve.kernels import AttentionMetadata, fused_ops, triton_norm, triton_rope  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="forces the CUDA path onto CPU tensors: needs Triton's interpreter")
TOL = dict(atol=1e-4, rtol=1e-4)      # test_models.py's against HF: float32 sums in another order


@pytest.fixture
def launches(monkeypatch):
    """Count the kernels' launches: {"norm": n, "rope": n}."""
    counts = {"norm": 0, "rope": 0}
    for name, module, fn in (("norm", triton_norm, "rms_norm"), ("rope", triton_rope, "rotary_qk")):
        def counted(*args, _f=getattr(module, fn), _name=name, **kwargs):
            counts[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(module, fn, counted)
    return counts


def _fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(fused_ops, "NORM", "1" if on else "auto")
    monkeypatch.setattr(fused_ops, "ROPE", "1" if on else "auto")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_logits_equal_the_cpu_path(tmp_path, arch, monkeypatch, launches):
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path)
    ids = torch.randint(0, config.vocab_size, (PROMPT_LEN + 1,), generator=torch.Generator().manual_seed(1))
    want = run_prefill_then_decode(model, config, ids)
    assert launches == {"norm": 0, "rope": 0}                        # auto on CPU: no kernel
    _fused(monkeypatch, True)
    got = run_prefill_then_decode(model, config, ids)
    norms_per_step = config.num_layers * (2 + 2 * config.qk_norm) + 1
    assert launches == {"norm": 2 * norms_per_step, "rope": 2 * config.num_layers}
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fused_pipeline_stages_compose(tmp_path, monkeypatch):
    """A first stage hands on h with its last MLP output added; the last stage's final norm adds its own."""
    make_hf_model("llama", tmp_path)
    full, config = load_model(tmp_path)
    first, _ = load_model(tmp_path, num_layers=1)
    last, _ = load_model(tmp_path, first_layer=1)
    ids = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata.build([PROMPT_LEN], [PROMPT_LEN], [BLOCK_TABLE], BLOCK_SIZE)
    pos = torch.arange(PROMPT_LEN)
    with torch.inference_mode():
        want = full(ids, pos, config.kv_layout(num_layers=2).allocate(8, BLOCK_SIZE), meta)
        _fused(monkeypatch, True)
        layout = config.kv_layout(num_layers=1)
        h = first(ids, pos, layout.allocate(8, BLOCK_SIZE), meta)
        got = last(None, pos, layout.allocate(8, BLOCK_SIZE), meta, hidden=h)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_rows_only_last_layer(tiny_models, arch, monkeypatch):
    """``logit_rows``: the layers before the last fused, the last one's rows on a plain h."""
    model, config = load_model(tiny_models[arch])
    want, want_kv = run_logit_rows(model, config, "torch", keep=False)
    _fused(monkeypatch, True)
    kept, kept_kv = run_logit_rows(model, config, "torch", keep=True)
    full, _ = run_logit_rows(model, config, "torch", keep=False)
    torch.testing.assert_close(kept, want, **TOL)
    torch.testing.assert_close(full, want, **TOL)
    torch.testing.assert_close(kept_kv, want_kv, **TOL)


@pytest.mark.parametrize("arch, backend", [("llama", None), ("qwen3", None), ("llama", "triton")])
def test_fused_engine_greedy_tokens_equal_the_cpu_path_and_hf(tmp_path, arch, backend, monkeypatch, launches):
    """The engine's greedy tokens with the fused path forced equal the default CPU path's and HF's; with the
    Triton attention backend too, every kernel of a CUDA step runs (interpreted)."""
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, num_layers=2)
    ref = hf_model(model_dir)
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 7, 21)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16,
                  enable_prefix_caching=False, attention_backend=backend)
        return [o.token_ids for o in llm.generate(prompts, params)]

    want = greedy()
    _fused(monkeypatch, True)
    got = greedy()
    assert launches["norm"] > 0 and launches["rope"] > 0
    assert got == want == [hf_greedy(ref, p, 5) for p in prompts]
