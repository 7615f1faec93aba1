"""torch.compile of the layers' non-attention parts (engine/runner/compile.py): same greedy tokens as HF and as eager.

Compile is off by default (and conftest sets PDSERVE_COMPILE=0); ``test_compiled_greedy_equals_hf_and_eager`` is
the one that compiles (inductor, ~10-20 s on a small box the first time).
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams, envs
from pdserve.engine.config import EngineConfig, ExecutionConfig, ParallelConfig
from pdserve.engine.runner.compile import CompiledLayers

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_compiled_greedy_equals_hf_and_eager(tiny_llama):
    from torch._dynamo.utils import counters

    ref = hf_model(tiny_llama)
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 17, 300, 64)]
    llm = LLM(str(tiny_llama), torch_compile=True, max_num_batched_tokens=128, block_size=8)
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    graphs = counters["stats"]["unique_graphs"]
    calls = _count_calls(compiled)
    outs = llm.generate(prompts, GREEDY)              # prefill chunks of 128, mixed steps, decode batches 1..4
    assert calls["n"] > 0, "no step ran the compiled pieces"
    assert counters["stats"]["unique_graphs"] == graphs, "a step size recompiled: the token dim is not dynamic"
    eager = LLM(str(tiny_llama), torch_compile=False, max_num_batched_tokens=128, block_size=8)
    assert eager.engine.runner.compiled is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in prompts]


def _count_calls(compiled: CompiledLayers) -> dict:
    calls, pieces_for = {"n": 0}, compiled.pieces_for

    def counted(num_tokens: int):
        pieces = pieces_for(num_tokens)
        calls["n"] += pieces is not None
        return pieces

    compiled.pieces_for = counted
    return calls


def test_small_steps_run_eagerly():
    compiled = CompiledLayers(torch.nn.Module(), min_tokens=16)      # torch.compile is lazy: nothing compiles
    assert compiled.pieces_for(15) is None
    assert compiled.pieces_for(16) is compiled.pieces


@pytest.mark.parametrize("kwargs, expected", [
    ({}, True),
    ({"execution": ExecutionConfig(enforce_eager=True, torch_compile=True)}, False),
    ({"execution": ExecutionConfig(torch_compile=False)}, False),
    ({"device": "cuda"}, False),
    ({"parallel": ParallelConfig(tensor_parallel_size=2)}, False),
])
def test_compile_only_on_the_single_process_cpu_path(kwargs, expected):
    config = EngineConfig(model="m", **{"execution": ExecutionConfig(torch_compile=True), **kwargs})
    assert config.compiles_model is expected


def test_compile_defaults_to_the_environment(monkeypatch):
    assert EngineConfig(model="m").compiles_model is envs.PDSERVE_COMPILE is False      # conftest: eager tests
    monkeypatch.setattr(envs, "PDSERVE_COMPILE", True)
    assert EngineConfig(model="m").compiles_model is True


@pytest.mark.parametrize("raw, ok", [("", True), ("0", True), ("1", True), ("yes", False), ("2", False)])
def test_pdserve_compile_values(monkeypatch, raw, ok):
    monkeypatch.setenv("PDSERVE_COMPILE", raw)
    if ok:
        assert envs._bool("PDSERVE_COMPILE", True) is (raw != "0")
    else:
        with pytest.raises(ValueError, match="PDSERVE_COMPILE"):
            envs._bool("PDSERVE_COMPILE", True)


def test_compile_is_off_unless_asked_for():
    """Off by default (compiled and eager steps round differently: a prompt's KV bytes would depend on its
    chunking); ``pdserve node --torch-compile`` or PDSERVE_COMPILE=1 turns it on."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_COMPILE"}
    code = ("import sys; from pdserve.engine import envs; from pdserve.engine.cli import build_parser; "
            "a = build_parser().parse_args(['node', '--model', 'x', *sys.argv[1:]]); "
            "print(envs.PDSERVE_COMPILE, a.torch_compile)")
    run = lambda *flags: subprocess.run([sys.executable, "-c", code, *flags], env=env, capture_output=True,  # noqa: E731
                                        text=True, check=True).stdout.split()
    assert run() == ["False", "None"]
    assert run("--torch-compile") == ["False", "True"]
    assert run("--no-torch-compile") == ["False", "False"]
