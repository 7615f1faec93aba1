"""The start-up warm-up compiles every Triton attention kernel a request can launch (issue 38, item 10 ii).

On a GPU, prefill kernels used to compile inside live requests (~2.5 s each): only decode shapes were warmed (by
the graph capture), and each step's lengths, split count and metadata views picked new Triton specialisations.
Here, without a GPU:
- random steps (batch, lengths, planned or fixed split counts) launch only kernels that the warm-up's fake steps
  launch, compared by Triton's own specialisation key for an sm_90 target (``offline_compile.unwarmed``, in a
  subprocess: the key needs the compiled-mode ``@triton.jit``, not the interpreter's), for many model shapes;
- each fake step makes the planner pick the variant it stands for, and writes nothing into the KV cache;
- on CPU, or with another backend, the warm-up does nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.runner.kernel_warmup import model_shape, run_fake_steps, warm_attention, warmup_steps
from pdserve.kernels.attention_plan import plan_attention
from pdserve.kernels.kernel_variants import ModelShape

SHAPES = [(h, hkv, d, dt, 16) for dt in ("bfloat16", "float16", "float32") for d in (64, 80, 128, 256)
          for h, hkv in ((8, 8), (16, 8), (28, 4), (64, 8), (12, 2))] + \
    [(32, 8, 128, "bfloat16", 16, 4096), (16, 4, 96, "float32", 32, 64)]    # ModelShape's fields, windowed


def test_random_steps_launch_only_warmed_kernels():
    pytest.importorskip("triton", reason="triton is not installed")
    code = ("import json, sys; from pdserve.kernels.offline_compile import unwarmed; "
            "from pdserve.kernels.kernel_variants import ModelShape; "
            "print(json.dumps({str(s): unwarmed(ModelShape(*s), 60, seed=i) "
            "for i, s in enumerate(json.loads(sys.argv[1]))}))")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-P", "-c", code, json.dumps(SHAPES)], env=env, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    misses = {shape: m for shape, m in json.loads(run.stdout.splitlines()[-1]).items() if m}
    assert not misses, json.dumps(misses, indent=1)[:3000]


@pytest.mark.parametrize("shape", [ModelShape(32, 8, 128, "bfloat16"), ModelShape(28, 4, 256, "float32", 16, 512),
                                   ModelShape(8, 8, 64, "float16", 4)], ids=str)
def test_each_fake_step_picks_its_variant_and_writes_nothing(shape):
    calls = []
    runner = SimpleNamespace(device=torch.device("cpu"), block_size=shape.block_size, attention_backend="triton",
                             kv_caches=[], model=lambda ids, pos, caches, meta: calls.append((ids, meta)))
    steps = warmup_steps(shape)
    run_fake_steps(runner, steps)
    assert len(calls) == len(steps) == len({(s.tiles, s.num_splits) for s in steps})
    assert steps[0].kind == "decode" and {s.num_splits > 1 for s in steps} == {True, False}   # fp32 D 256: one tile
    for step, (ids, meta) in zip(steps, calls):
        plan = plan_attention(ids.shape[0], meta.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                              meta.max_query_len, meta.max_seq_len, shape.fp32, meta.num_splits)
        assert (plan.block_m, plan.block_n, plan.num_warps, plan.q_chunk) == \
            (step.tiles.block_m, step.tiles.block_n, step.tiles.num_warps, step.tiles.q_chunk)
        assert (plan.num_splits > 1) == (step.num_splits > 1)
        assert (meta.slot_mapping == -1).all()


def test_no_warmup_on_cpu_or_other_backends():
    def model(*args):
        raise AssertionError("the warm-up ran the model")

    for device, backend in (("cpu", "triton"), ("cpu", "cpu"), ("cuda", "torch")):
        runner = SimpleNamespace(device=torch.device(device), attention_backend=backend, model=model)
        assert warm_attention(runner) is None


def test_model_shape_of_a_runner(tiny_llama):
    from pdserve.engine import LLM
    from pdserve.engine.models.model_config import ModelConfig

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", attention_backend="torch", max_model_len=256)
    config = ModelConfig.from_dir(tiny_llama, dtype="float32")
    assert model_shape(llm.engine.runner) == ModelShape(config.num_heads, config.num_kv_heads, config.head_dim,
                                                        "float32", llm.engine.runner.block_size, None)
    llm.shutdown()


def test_norm_row_counts_and_transfer_lengths_share_the_warmed_compile():
    """The fused RMSNorm's row count and a chunk's length are not specialised: the warm-up's launches (a fake step's
    rows, one skipped slot each way) compile what any step or chunk launches, for an sm_90 target."""
    pytest.importorskip("triton", reason="triton is not installed")
    code = ("import json; from pdserve.kernels.offline_compile import norm_key, transfer_key; "
            "from pdserve.kernels.kernel_variants import ModelShape; "
            "norm = {f'{w} {dt} {res}': len({norm_key(r, w, dt, res) for r in (1, 2, 16, 17, 255, 4096)}) "
            "for w in (128, 2048, 4096) for dt in ('bfloat16', 'float32') for res in (False, True)}; "
            "shapes = [ModelShape(32, 8, 128, 'bfloat16'), ModelShape(16, 2, 64, 'float16'), "
            "ModelShape(8, 8, 256, 'float32', 32)]; "
            "xfer = {f'{s} {tc}': len({transfer_key(s, 1, tc)} | {transfer_key(s, n, tc, h) "
            "for n in (5, 16, 256) for h in (1, 2, 4)}) for s in shapes for tc in (False, True)}; "
            "print(json.dumps({'norm': norm, 'transfer': xfer}))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert all(n == 1 for n in got["norm"].values()), got["norm"]
    assert all(n == 1 for n in got["transfer"].values()), got["transfer"]
