"""No false kills, no rank death on a KV copy error, no stray signals: tp2 engines in this process.

Faults: PDSERVE_FAULTS=slow_layers (``parallel/faults.py``) slows the ranks' decoder layers while a
file says so, ticking their heartbeats (a step several --rank-timeouts long that keeps moving); the
tests send KV scatters larger than the broadcast ring (16 slots x 256 KiB) while such a step runs.

- a scatter larger than the ring, sent during a step 3x --rank-timeout long, waits for the step: no kill
- a rank's KV copy error comes back as ``KVCopyError``; every rank lives on and the engine still serves
- shutdown while a multi-frame scatter is being written: the Shutdown message waits for the send lock,
  every rank exits 0, and the driver signals no process at all
- gloo's collective timeout is far beyond the watchdog's (the 70 s end-to-end run is the
  ``slow-stage`` case of devbench/parallel_lifecycle.py)
- the rendezvous store, and gloo's listeners, are on 127.0.0.1 only
"""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hf_reference import random_prompt
from lifecycle_probe import listening_ports
from parallel_probes import SignalLog, listen_addresses
from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.parallel.kv import KVCopyError
from pdserve.engine.parallel.worker import collective_timeout
from pdserve.engine.sampling_params import SamplingParams
from polling import wait_until

RANK_TIMEOUT = 1.0
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(model_dir, slow_file, monkeypatch, rank_timeout: float = RANK_TIMEOUT) -> LLMEngine:
    monkeypatch.setenv("PDSERVE_FAULTS", f"slow_layers={slow_file}")        # read by the launcher and ranks
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       parallel=ParallelConfig(tensor_parallel_size=2, rank_timeout=rank_timeout))
    return LLMEngine(cfg)


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory):
    return tmp_path_factory.mktemp("faults") / "slow"


@pytest.fixture(scope="module")
def engine(tiny_llama, slow_file):
    """Shared by the tests that leave it healthy."""
    with pytest.MonkeyPatch.context() as mp:
        eng = _engine(tiny_llama, slow_file, mp)
    yield eng
    eng.shutdown()


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def _start_slow_step(engine: LLMEngine, slow_file, seconds_per_layer: float, pool: ThreadPoolExecutor):
    """A request past its prefill, then its next step on ``pool`` with slowed layers; returns once the ranks
    are inside that step. -> the step's future."""
    engine.add_request(f"r{engine.runner.step}", random_prompt(500, 20, seed=3), PARAMS)
    engine.step()                                            # the prefill, at full speed
    slow_file.write_text(str(seconds_per_layer))
    step, hb = engine.runner.step + 1, engine.runner.heartbeat
    stepping = pool.submit(engine.step)
    wait_until(lambda: all(s.step == step and s.phase != "recv_scheduler_output" for s in hb.states()),
               30, f"every rank inside step {step}")
    return stepping


def _oversized(engine: LLMEngine, tokens: int = 12000):
    """A scatter of ~6 MB (the ring holds 4 MiB) into the slots of the last block, which no request holds."""
    mc, bs, last = engine.model_config, engine.config.cache.block_size, engine.runtime.num_blocks - 1
    assert all(last not in r.block_ids for r in engine.scheduler.running)
    slots = torch.full((tokens,), last * bs, dtype=torch.long)
    data = torch.zeros(mc.num_layers, 2, tokens, mc.num_kv_heads, mc.head_dim, dtype=engine.layout.dtype)
    return slots, data


def test_oversized_scatter_during_a_long_moving_step_is_not_a_stall(engine, slow_file):
    with ThreadPoolExecutor(1) as pool:
        stepping = _start_slow_step(engine, slow_file, 1.5, pool)       # 2 layers: >= 3 s, ticking every 0.2 s
        try:
            engine.runner.kv_io.scatter(*_oversized(engine))           # blocks on the full ring until the step ends
        finally:
            slow_file.unlink()
        stepping.result(timeout=60)
    _finish(engine)
    assert engine.runner.failure is None


def test_a_rank_kv_copy_error_is_an_answer_not_a_death(engine):
    mc = engine.model_config
    past_the_cache = torch.tensor([engine.runtime.num_blocks * 8 + 3])
    data = torch.zeros(mc.num_layers, 2, 1, mc.num_kv_heads, mc.head_dim, dtype=engine.layout.dtype)
    with pytest.raises(KVCopyError, match=r"rank 0: \w+Error: .*; rank 1: \w+Error"):
        engine.runner.kv_io.scatter(past_the_cache, data)
    with pytest.raises(KVCopyError, match=r"rank 0: \w+Error: .*; rank 1: \w+Error"):
        engine.runner.kv_io.gather(past_the_cache)
    engine.add_request("after", random_prompt(500, 9, seed=5), PARAMS)
    _finish(engine)
    assert engine.runner.failure is None


def test_the_rendezvous_store_is_private_and_gloo_listens_on_loopback_only(engine):
    ex = engine.runner
    store_dir = Path(ex._store_file).parent               # --nnodes 1: a FileStore, no TCP listener of its own
    assert isinstance(ex.store, torch.distributed.FileStore) and stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    gloo = listening_ports(ex.rank_pids())
    assert gloo and all(listen_addresses(port) == ["127.0.0.1"] for port in gloo)
    for pid in ex.rank_pids():                   # and not because the hostname happens to resolve to 127.0.0.1
        assert b"GLOO_SOCKET_IFNAME=lo\0" in Path(f"/proc/{pid}/environ").read_bytes()


def test_gloo_never_gives_up_before_the_watchdog():
    for rank_timeout in (1.0, 60.0, 3600.0):
        assert collective_timeout(rank_timeout) >= max(timedelta(hours=24), timedelta(seconds=100 * rank_timeout))


def test_shutdown_during_a_scatter_waits_for_it_and_every_rank_exits_0(tiny_llama, tmp_path, monkeypatch):
    slow_file = tmp_path / "slow"
    engine = _engine(tiny_llama, slow_file, monkeypatch, rank_timeout=5.0)
    ex = engine.runner
    try:
        with ThreadPoolExecutor(2) as pool:
            stepping = _start_slow_step(engine, slow_file, 1.0, pool)
            full = ex.outbox._seq + ex.ch.broadcast.num_slots
            scattering = pool.submit(ex.kv_io.scatter, *_oversized(engine))
            wait_until(lambda: ex.outbox._seq >= full, 30, "the scatter filled the ring")
            slow_file.unlink()
            signals = SignalLog(monkeypatch)
            ex.shutdown()                                    # while the scatter waits for room in the ring
            stepping.result(timeout=60)
            scattering.result(timeout=60)
        assert [s.exit for s in ex.heartbeat.states()] == [1, 1]     # exit code 0 (+ 1), both ranks
        assert signals.calls == []
    finally:
        engine.shutdown()
