"""`pdserve node -tp 2` end to end: it serves the single-rank engine's greedy text over HTTP; a rank SIGKILLed while idle is
unrecoverable: the node logs the watchdog's report and exits 1 (so its supervisor restarts it), and no rank or launcher
is left."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from hf_reference import random_prompt
from pdserve.engine import LLM, SamplingParams


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_tp2_node_serves_then_reports_a_dead_rank(node_factory, tiny_llama):
    node = node_factory(tiny_llama, "-tp", "2", "--rank-timeout", "2")
    prompt = random_prompt(500, 12, seed=4)
    ok = _complete(node.url, prompt)
    assert ok.status_code == 200, ok.text
    [single] = LLM(str(tiny_llama)).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert ok.json()["choices"][0]["text"] == single.text
    [launcher] = _children(node.proc.pid)
    ranks = _children(launcher)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    assert node.proc.wait(timeout=60) == 1                                   # noticed while idle
    assert "rank 1 (tp 1, pp 0) exited (killed by SIGKILL)" in node.stop()
    for pid in (launcher, *ranks):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
