"""The engine with the Triton attention backend gives HF's greedy tokens (kernels run in Triton's interpreter).

Runs in a child process with ``TRITON_INTERPRET=1 PDSERVE_ATTENTION_BACKEND=triton`` (the variable
must be set before triton is imported), on tiny fp32 models with 4-token blocks and a 16-token
step budget, so one run covers a first prefill chunk, an extend chunk over cached blocks, lengths
ending mid-block, batched decode rows of different lengths, and a sliding window (mistral).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.checkpoints.tiny_model import make_tiny_model

CHILD = r"""
import json, sys
from pdserve.engine import LLM, SamplingParams
model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
assert llm.engine.runner.attention_backend == "triton"
outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_backend_greedy_equals_hf(tmp_path, arch):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, num_layers=2)
    if arch == "mistral":                                 # a window shorter than the prompts
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
    ref = hf_model(model_dir)
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 7, 21)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDSERVE_ATTENTION_BACKEND": "triton"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [hf_greedy(ref, p, 5) for p in prompts]
