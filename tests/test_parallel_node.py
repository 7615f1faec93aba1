"""`pdserve node -tp 2` end to end: it serves the single-rank engine's greedy text over HTTP; a rank SIGKILLed while idle turns
/health to 503, the next request fails with the watchdog's report, and no rank or launcher is left."""

from __future__ import annotations

import os
import signal
import time
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
    deadline = time.monotonic() + 30
    while httpx.get(node.url + "/health", timeout=5).status_code != 503:     # noticed while idle
        assert time.monotonic() < deadline, "the node stayed healthy after a rank died"
        time.sleep(0.1)
    failed = _complete(node.url, prompt)
    assert failed.status_code == 500
    assert "rank 1 (tp 1, pp 0) exited (killed by SIGKILL)" in failed.json()["error"]["message"]
    for pid in (launcher, *ranks):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
