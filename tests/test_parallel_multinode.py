"""--nnodes 2 on one machine: the driver runs ranks 0-1 (stage 0), ``pdserve node --node-rank 1`` runs 2-3.

The second "machine" reaches the driver only through TCP: the rendezvous store, the zmq side of
the broadcast queue, zmq result / KV / heartbeat-mirror channels. Greedy output equals HF, and a
rank killed on node 1 is reported by the driver with its coordinates (through the mirror), after
which node 1's launcher kills its other rank and exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.parallel.executor import RankFailedError
from pdserve.engine.sampling_params import SamplingParams


class TwoNodes:
    def __init__(self, model_dir, rank_timeout: float = 30.0):
        port = free_port()
        flags = ["-tp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        self.node1 = subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "node", "--model", str(model_dir),
                                       "--node-rank", "1", *flags])
        par = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, master_port=port,
                             rank_timeout=rank_timeout)
        try:
            self.engine = LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8), parallel=par))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()
        try:
            self.node1.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.node1.kill()
            self.node1.wait()
            raise


@pytest.fixture()
def nodes(tiny_llama):
    n = TwoNodes(tiny_llama, rank_timeout=5.0)
    yield n
    n.stop()


def _generate(engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def test_two_nodes_greedy_equals_hf(nodes, tiny_llama):
    ref = hf_model(tiny_llama)
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (3, 40)]
    assert _generate(nodes.engine, prompts, 8) == [hf_greedy(ref, p, 8) for p in prompts]
    nodes.stop()
    assert nodes.node1.returncode == 0


def test_rank_killed_on_the_other_node_is_named(nodes):
    executor = nodes.engine.runner
    deadline = time.monotonic() + 30
    while executor.heartbeat.states()[3].pid == 0:            # the first mirror carries rank 3's pid
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(executor.heartbeat.states()[3].pid, signal.SIGKILL)      # same machine here: a test shortcut
    with pytest.raises(RankFailedError) as err:
        _generate(nodes.engine, [random_prompt(500, 10, seed=3)], 2000)
    assert re.match(r"rank 3 \(tp 1, pp 1\) exited \(killed by SIGKILL\) in step \d+ at phase \w+", str(err.value))
    nodes.node1.wait(timeout=30)                               # its launcher killed rank 2 and left
    for pid in executor.pids():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
