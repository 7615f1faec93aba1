"""Review 14 (hostile tester): defects found in this session's changes, each a failing test before its fix."""

from __future__ import annotations

import os

import pytest

from pdserve.engine import envs
from pdserve.engine.config import ConfigError
from pdserve.engine.runner.compile import use_cache_dir


def test_unusable_compile_cache_dir_is_named_and_compiling_goes_on_privately(tmp_path, monkeypatch, caplog):
    """PDSERVE_CACHE_DIR under a file: compiling failed the node's start with inductor's bare NotADirectoryError,
    naming neither the variable nor --enforce-eager. Now a cache folder that cannot be used (or trusted: inductor
    loads what it finds there as code, issue 35) is named with the variable, and this process compiles into a
    private temporary folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")            # unset for the call, restored after it
    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", blocker / "cache")
    used = use_cache_dir()
    assert not used.startswith(str(tmp_path)) and os.path.isdir(used) and os.stat(used).st_mode & 0o777 == 0o700
    assert "PDSERVE_CACHE_DIR" in caplog.text and str(blocker / "cache") in caplog.text


def test_writable_compile_cache_dir_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", tmp_path / "fresh")
    assert use_cache_dir() == str(tmp_path / "fresh" / "inductor")
    assert os.path.isdir(tmp_path / "fresh" / "inductor")
    assert os.listdir(tmp_path / "fresh" / "inductor") == []      # the probe file is gone


@pytest.mark.xfail(strict=True, reason="not fixed: inductor's fused bf16 pointwise code rounds differently from "
                   "eager (emulate_precision_casts does not close it); steps of >= 64 tokens change the tokens")
def test_compiled_bfloat16_greedy_equals_eager(tiny_llama):
    """--dtype bfloat16 with compile (on by default): compiled greedy differed from eager in 5 of these 6 prompts
    (first divergence at tokens 0-22), and a prompt's tokens depended on whether it shared its steps with others
    (the step crossed the 64-token threshold); eager bf16 gave the same tokens alone and batched."""
    from hf_reference import random_prompt
    from pdserve.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [random_prompt(500, n, seed=n) for n in (70, 90, 130, 200, 65, 100)]
    outs = {}
    for compiled in (True, False):
        llm = LLM(str(tiny_llama), dtype="bfloat16", torch_compile=compiled, max_num_batched_tokens=512)
        outs[compiled] = [list(o.token_ids) for o in llm.generate(prompts, greedy)]
    assert outs[True] == outs[False]


def test_short_rank_timeout_names_the_way_out_of_the_default_core():
    """The engine core runs in its own process by default now: a user who never typed --engine-core-process
    was told its --rank-timeout is too short for it, without the flag that turns it off."""
    from pdserve.engine.config import EngineConfig, ParallelConfig

    with pytest.raises(ConfigError, match=r"use >= 2 s, or --no-engine-core-process"):
        EngineConfig(model="m", engine_core_process=True, parallel=ParallelConfig(rank_timeout=1.0))
