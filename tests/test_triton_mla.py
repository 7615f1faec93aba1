"""The Triton MLA kernels (``kernels/triton_mla.py``) equal their torch reference, in Triton's interpreter on CPU.

Tiny shapes (4 heads in a 16-head tile, L 32, R 8 padded to 16, 4-token blocks): ragged lengths across block
edges, shuffled block tables, one split and several (the split-K reduce, a split with no keys included). Cache rows
past each sequence's end and unused blocks hold NaN, so a read past an end shows in the output. The latent write
is bit-exact and skips padding slots. The engine with the Triton backend gives HF's greedy tokens on a tiny V3
(a child process: the interpreter must be on before triton is imported). The compiled sm_90 build is checked by
``tests/test_kernel_compile.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from hf_reference import hf_greedy, hf_model, random_prompt  # noqa: E402
from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek  # noqa: E402
from pdserve.kernels import AttentionMetadata, mla_reference  # noqa: E402
from pdserve.kernels import triton_mla  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
BS, H, L, R = 4, 4, 32, 8


def _case(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + BS - 1) // BS for n in lens]
    perm = (torch.randperm(sum(blocks), generator=g) + 1).tolist()
    tables, i = [], 0
    for nb in blocks:
        tables.append(perm[i:i + nb])
        i += nb
    latent = torch.full((sum(blocks) + 2, BS, 1, L + R), float("nan"))
    for b, n in enumerate(lens):                          # only each sequence's own positions hold numbers
        for p in range(n):
            latent[tables[b][p // BS], p % BS, 0] = torch.randn(L + R, generator=g)
    q = torch.randn(len(lens), H, L + R, generator=g)
    return q, {"latent": latent}, tables


@pytest.mark.parametrize("lens,splits", [([1], 1), ([5, 16, 17, 3], 1), ([5, 16, 17, 3], 3), ([40, 2], 4)])
def test_decode_equals_reference(lens, splits):
    q, cache, tables = _case(lens)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, BS)
    want = mla_reference.mla_decode(q, {"latent": torch.nan_to_num(cache["latent"])}, meta, 0.25, L)
    dev = AttentionMetadata.build([1] * len(lens), lens, tables, BS, device=DEVICE, backend="triton")
    dev.num_splits = splits
    got = triton_mla.mla_decode(q.to(DEVICE), {"latent": cache["latent"].to(DEVICE)}, dev, 0.25, L)
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_write_latent_is_exact_and_skips_padding():
    cache = {"latent": torch.zeros(3, BS, 1, L + R, device=DEVICE)}
    rows = torch.randn(4, L + R, device=DEVICE)
    slots = torch.tensor([6, -1, 0, 11], dtype=torch.int32, device=DEVICE)
    triton_mla.write_latent(rows, cache, slots)
    want = {"latent": torch.zeros(3, BS, 1, L + R)}
    mla_reference.write_latent(rows.cpu(), want, slots.cpu())
    assert torch.equal(cache["latent"].cpu(), want["latent"])


CHILD = r"""
import json, sys
from pdserve.engine import LLM, SamplingParams
model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=16)
assert llm.engine.runner.attention_backend == "triton"
outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


def test_engine_with_triton_backend_greedy_equals_hf(tmp_path):
    model_dir = make_tiny_deepseek(tmp_path / "v3", "deepseek_v3", seed=2, q_lora_rank=24)
    ref = hf_model(model_dir)
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 7, 21)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDSERVE_ATTENTION_BACKEND": "triton"}
    proc = subprocess.run([sys.executable, "-P", "-c", CHILD, str(model_dir), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [hf_greedy(ref, p, 4) for p in prompts], proc.stdout[-2000:] + proc.stderr[-3000:]
