"""The rank watchdog end to end: a tp2 x pp2 ``AsyncEngine`` whose ranks we SIGKILL / SIGSTOP mid-generation.

- SIGKILL rank 1 (tp 1, pp 0) while it is inside a step -> the in-flight request fails with a report
  naming rank 1, its coordinates, the step and phase it died in; the engine turns unhealthy; every
  rank is gone; all within --rank-timeout + 5 s; the driver signalled no pid but its own launcher's
  (the launcher kills the ranks it has not reaped: a reaped rank's pid may belong to anyone now).
- SIGSTOP rank 2 (tp 0, pp 1) -> the same, "stalled ... (process stopped)", after --rank-timeout.
- A rank stopped again and again for 0.6 s (the generation is slow but moves) is never reported.

The phase expected in the report is read from the heartbeat once the signal has landed (the
process can no longer change it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from hf_reference import random_prompt
from parallel_probes import SignalLog
from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.outputs import EngineDeadError
from pdserve.engine.sampling_params import SamplingParams

RANK_TIMEOUT = 2.0
IDLE = ("starting", "recv_scheduler_output")


@pytest.fixture()
def engine(tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8),
                       parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                               rank_timeout=RANK_TIMEOUT))
    eng = AsyncEngine(cfg)
    yield eng
    eng.shutdown()                                        # also stops the ranks (SIGKILL ends stopped ones)


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, params, rid):
        tokens += out.new_token_ids
    return tokens


def _signal_mid_step(executor, rank: int, sig: int) -> tuple[float, object]:
    """Send ``sig`` to ``rank`` once it is inside a step (after step 3); -> (time sent, its frozen state)."""
    deadline = time.monotonic() + 60
    while True:
        state = executor.heartbeat.states()[rank]
        if state.step > 3 and state.phase not in IDLE:
            break
        assert time.monotonic() < deadline, f"rank {rank} never got inside a step after step 3: {state}"
        time.sleep(0.0005)                                     # poll, do not spin a core the ranks need
    pid = state.pid
    os.kill(pid, sig)
    sent = time.monotonic()
    while not (_stopped(pid) if sig == signal.SIGSTOP else _gone(pid)):      # the signal landed
        time.sleep(0.001)
    return sent, executor.heartbeat.states()[rank]


def _proc_state(pid: int) -> str:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


def _stopped(pid: int) -> bool:
    return _proc_state(pid) in ("T", "t")


def _gone(pid: int) -> bool:
    return _proc_state(pid) in ("Z", "X", "gone")


async def _fault_run(engine: AsyncEngine, rank: int, sig: int):
    prompt = random_prompt(500, 20, seed=1)
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(_collect(engine, prompt, params, "victim"))
    pids = engine.engine.runner.pids()
    sent, state = await asyncio.to_thread(_signal_mid_step, engine.engine.runner, rank, sig)
    with pytest.raises(EngineDeadError) as err:
        await task
    return time.monotonic() - sent, state, str(err.value), pids


def _assert_all_gone(pids: list[int]) -> None:
    """The ranks and their launcher: killed and reaped, nothing left running."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigkill_names_rank_coordinates_and_phase(engine, monkeypatch):
    signals = SignalLog(monkeypatch)
    elapsed, state, message, pids = asyncio.run(_fault_run(engine, 1, signal.SIGKILL))
    launcher = engine.engine.runner.launcher.pid
    assert all(pid == launcher for pid, _ in signals.calls if (pid, _) != (state.pid, signal.SIGKILL)), signals.calls
    assert re.search(rf"rank 1 \(tp 1, pp 0\) exited \(killed by SIGKILL\) in step {state.step} "
                     rf"at phase {state.phase}; ", message), message
    assert not engine.is_healthy()             # time to report: devbench/parallel_lifecycle.py (not a test's clock)
    _assert_all_gone(pids)


def test_sigstop_is_reported_as_a_stall_after_the_rank_timeout(engine):
    elapsed, state, message, pids = asyncio.run(_fault_run(engine, 2, signal.SIGSTOP))
    assert re.search(rf"rank 2 \(tp 0, pp 1\) stalled in step {state.step} at phase {state.phase} "
                     rf"for \d+\.\ds \(process stopped\)", message), message
    assert not engine.is_healthy()
    _assert_all_gone(pids)


def test_slow_but_progressing_rank_is_not_reported(engine, tiny_llama):
    """A rank frozen for less than --rank-timeout, three times, while a request is necessarily in flight
    (it cannot finish while the rank is stopped): every answer is right and nothing is reported. Each
    freeze starts before its request, so the test does not depend on how long a generation lasts."""
    from pdserve.engine import LLM

    prompt = random_prompt(500, 30, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    [expected] = LLM(str(tiny_llama), block_size=8).generate([prompt], params)
    pid = engine.engine.runner.heartbeat.states()[3].pid
    for i in range(3):
        got = []
        os.kill(pid, signal.SIGSTOP)
        worker = threading.Thread(target=lambda: got.append(asyncio.run(_collect(engine, prompt, params, f"slow{i}"))))
        try:
            worker.start()
            worker.join(timeout=0.3 * RANK_TIMEOUT)           # the freeze: well under --rank-timeout
            assert worker.is_alive(), "a request finished while a rank was stopped"
        finally:
            os.kill(pid, signal.SIGCONT)
        worker.join(timeout=120)
        assert got == [expected.token_ids]
    assert engine.is_healthy() and engine.engine.runner.failure is None


DRIVER = """
import signal, sys
import torch
torch.set_num_threads(1)
from pdserve.engine.config import EngineConfig, ParallelConfig
from pdserve.engine.core.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)))
print(" ".join(map(str, engine.runner.pids())), engine.runner._store_file, flush=True)
signal.pause()                     # hold the ranks until the test SIGKILLs this driver
"""


def test_a_killed_driver_leaves_no_rank_behind(tiny_llama):
    """Nor the directory of the ranks' FileStore: the launcher removes it when the driver's lifeline ends."""
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tiny_llama)], stdout=subprocess.PIPE, text=True)
    try:
        *pids, store_file = driver.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 5 and os.path.exists(store_file)    # 4 ranks + their launcher
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 30
    while any(not _gone(pid) for pid in pids):                  # ranks see the writer gone, the launcher follows
        assert time.monotonic() < deadline, [(pid, _proc_state(pid)) for pid in pids]
        time.sleep(0.05)
    assert not os.path.exists(os.path.dirname(store_file))
