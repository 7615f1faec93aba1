"""Every Triton kernel variant the planner can choose compiles for sm_90 without a register spill (issue 38).

No GPU needed: ``devbench/compile_table.py`` builds each kernel with Triton's bundled ptxas for a
GPUTarget("cuda", 90, 32) and reads ptxas -v's report (``kernels/offline_compile.py``). The matrix: bf16 / fp16 /
fp32 x head dims 64, 96, 128, 192, 256 x GQA ratios 1..8, every tile choice of the attention planner
(``kernels/kernel_variants.py``: decode and prefill, with and without split-K) and its reduce, one windowed model,
the cache write, the chunk gather/scatter, the fused norm / rope, the fused MoE's two GEMMs at each BLOCK_M, and
DeepSeek's MLA latent decode (one split and split-K), its reduce and the latent write (``kernels/triton_mla.py``),
each as its launch would compile it. Compiled once per test run (one subprocess, every core: 351 kernels, ~130 s
of CPU, 2-5 min on 2 busy cores); each test checks a part of the table. Skipped, with the reason, where triton or
its ptxas is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels.offline_compile import SM90_SMEM_LIMIT, ptxas_missing

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("bf16", "fp16", "fp32")
KERNELS = ("attn", "reduce", "write", "gather", "scatter", "norm", "rope", "moe", "mla", "mla_reduce", "mla_write")


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> list[dict]:
    missing = ptxas_missing()
    if missing:
        pytest.skip(f"no offline sm_90 compile here: {missing}")
    out = tmp_path_factory.mktemp("compile") / "table.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-P", str(ROOT / "devbench" / "compile_table.py"), "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"compile_table.py wrote no table (rc {run.returncode}):\n{run.stdout[-3000:]}\n"
                    f"{run.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_spill_and_smem_within_sm90(table, dtype, kernel):
    rows = [r for r in table if r["variant"].split()[:2] == [kernel, dtype]]
    assert rows, f"no {kernel} {dtype} variant in the table"
    bad = [f"{r['variant']}: {r['registers']} registers, {r['spill_stores']} B spill stores, "
           f"{r['smem']} B smem" for r in rows if r["spill_stores"] or r["spill_loads"] or r["smem"] > SM90_SMEM_LIMIT]
    assert not bad, "\n".join(bad)


def test_table_holds_every_planner_tile_choice(table):
    """Each (dtype, head dim) row group has the planner's every tile choice, with and without a split."""
    from pdserve.kernels.kernel_variants import ModelShape, attention_steps
    from pdserve.kernels.offline_compile import attention_label

    labels = {r["variant"] for r in table}
    for dtype in ("bfloat16", "float16", "float32"):
        for d in (64, 96, 128, 192, 256):
            for qpk in range(1, 9):
                shape = ModelShape(8 * qpk, 8, d, dtype)
                for step in attention_steps(shape):
                    assert attention_label(shape, step) in labels, (shape, step)


def test_table_holds_mla_decode_with_and_without_split(table):
    labels = {r["variant"] for r in table}
    for dt in DTYPES:
        for label in (f"mla {dt} L512 R64", f"mla {dt} L512 R64 split", f"mla_reduce {dt} L512 R64",
                      f"mla_write {dt} L512 R64"):
            assert label in labels, label


def test_table_holds_every_fused_moe_variant(table):
    """Per dtype: both grouped GEMMs (gate/up, weighted down) at each BLOCK_M the tile rule can pick."""
    from pdserve.kernels.kernel_variants import MOE_BLOCK_MS

    for dtype in DTYPES:
        rows = [r["variant"] for r in table if r["variant"].split()[:2] == ["moe", dtype]]
        for block_m in MOE_BLOCK_MS:
            for launch in ("gate_up", "down weighted"):
                assert any(f" M{block_m} " in v and v.endswith(launch) for v in rows), (dtype, block_m, launch, rows)
