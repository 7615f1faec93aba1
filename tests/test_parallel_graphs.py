"""Decode graphs on TP x PP ranks (``engine/parallel/graphs.py``), everything a CPU can check:

- the decision table: nccl -> graphs; gloo (a shared GPU, or --dist-backend gloo) -> eager with the reason;
  --enforce-eager -> eager; CPU -> eager (the stand-in only when PDSERVE_RANK_GRAPHS_CPU asks);
- the bucket of each micro-batch is a pure function of the broadcast StepMessage (the same after the wire);
- the heartbeat names a replay "graph replay (bucket b)", writes nothing of the replayed code's own phases, and
  under --debug-sync synchronises after the replay and logs it; capture writes and synchronises nothing;
- real CPU ranks running the captured stage function eagerly through the replay path (the stand-in): tp2, pp2 and
  tp2 x pp2 give tp1's and HF's greedy ids; a rank whose peer is SIGSTOPped blocks inside the replay phase and the
  watchdog's report says so.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, ExecutionConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.devices import DeviceChoice, agree, select_device
from pdserve.engine.parallel.executor import RankFailedError
from pdserve.engine.parallel.graphs import EAGER, GRAPHS, STAND_IN, batch_bucket, graph_mode, plan_step
from pdserve.engine.parallel.watchdog import Heartbeat, RankInfo, Watchdog
from pdserve.engine.runner.decode_splits import buckets
from pdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = DeviceChoice("cpu", None, "gloo", "CPU ranks: gloo")


# -- the decision table ------------------------------------------------------------------------------------------

def test_nccl_ranks_capture_and_every_other_rank_runs_eager_with_its_reason():
    nccl = select_device("cuda", 2, 1, 2)
    shared = select_device("cuda", 2, 1, 1)
    gloo_asked = select_device("cuda", 2, 1, 2, "gloo")
    assert (nccl.backend, shared.backend, gloo_asked.backend) == ("nccl", "gloo", "gloo")
    assert graph_mode(nccl, False, False).mode == GRAPHS
    assert "all-reduce inside the graph" in graph_mode(nccl, False, False).reason
    mode = graph_mode(shared, False, False)
    assert mode.mode == EAGER and "ranks share GPUs" in mode.reason and "cannot capture" in mode.reason
    mode = graph_mode(gloo_asked, False, False)
    assert mode.mode == EAGER and "--dist-backend gloo" in mode.reason and "cannot capture" in mode.reason
    mode = graph_mode(agree(nccl, ["nccl", "nccl", "gloo", "gloo"]), False, False)    # another machine shares GPUs
    assert mode.mode == EAGER and "on other machines share GPUs" in mode.reason
    for choice in (nccl, shared, CPU):
        for stand_in in (False, True):
            mode = graph_mode(choice, True, stand_in)
            assert mode.mode == EAGER and "--enforce-eager" in mode.reason and not mode.replays
    assert graph_mode(CPU, False, False).mode == EAGER and "need a GPU" in graph_mode(CPU, False, False).reason
    assert graph_mode(CPU, False, True).mode == STAND_IN
    assert graph_mode(shared, False, True).mode == EAGER          # the stand-in never replaces a GPU rank's choice


# -- the bucket: a pure function of the message ------------------------------------------------------------------

def _req(i: int, n: int = 1, start: int = 20) -> m.StepRequest:
    return m.StepRequest(f"r{i}", list(range(n)), start, list(range(-(-(start + n) // 8))), True)


def test_the_bucket_of_each_micro_batch_comes_from_the_message_alone():
    sizes = buckets(16)                                             # 1, 2, 4, 8, 16
    width = 4                                                       # blocks of 8: positions < 32
    assert [batch_bucket([_req(i) for i in range(n)], sizes, width, 8) for n in (1, 2, 3, 5, 8, 9, 16)] == \
        [1, 2, 4, 8, 8, 16, 16]
    assert batch_bucket([_req(i) for i in range(17)], sizes, width, 8) is None          # past the largest bucket
    assert batch_bucket([_req(0), _req(1, n=5)], sizes, width, 8) is None               # a prompt chunk: eager
    assert batch_bucket([_req(0), _req(1, start=32)], sizes, width, 8) is None          # needs a 5th block
    assert batch_bucket([_req(0, start=31)], sizes, width, 8) == 1
    assert batch_bucket([], sizes, width, 8) is None
    msg = m.StepMessage(7, [_req(i) for i in range(6)])
    wire = m.decode_driver_message(m.encode(msg))                   # what every rank dequeues
    for pp in (1, 2, 3):
        plan = plan_step(msg, pp, sizes, width, 8)
        assert plan == plan_step(wire, pp, sizes, width, 8)
        assert [len(b) for b, _ in plan] == [6 // pp] * pp
        assert [bucket for _, bucket in plan] == {1: [8], 2: [4, 4], 3: [2, 2, 2]}[pp]
    mixed = m.StepMessage(8, [_req(0, n=9), _req(1), _req(2), _req(3)])
    assert [bucket for _, bucket in plan_step(mixed, 2, sizes, width, 8)] == [None, 4]   # 9 tokens | 3 decodes


# -- the heartbeat around a replay -------------------------------------------------------------------------------

@pytest.fixture()
def heartbeat_fd():
    fd = Heartbeat.create(2)
    yield fd
    os.close(fd)


def test_a_replay_is_its_own_phase_and_hides_the_replayed_code_bookkeeping(heartbeat_fd):
    hb = Heartbeat(heartbeat_fd, 0)
    board = Heartbeat(heartbeat_fd)
    hb.begin_step(3)
    hb.enter("forward")
    with hb.replaying(8):
        hb.enter("all_reduce")                                      # a collective's phase inside the replayed code
        hb.tick()
        state = board.states()[0]
    assert (state.step, state.phase, state.seq) == (3, "graph replay (bucket 8)", 1)
    assert board.states()[0].phase == "forward"
    with hb.capturing():
        hb.enter("all_gather")
    assert board.states()[0].phase == "forward"
    hb.enter("sample")
    assert board.states()[0].phase == "sample"
    hb.close()
    board.close()


def test_debug_sync_synchronises_after_the_replay_and_logs_it_but_never_while_capturing(heartbeat_fd, caplog):
    synced: list[str] = []
    hb = Heartbeat(heartbeat_fd, 1, coords="tp 1, pp 0", sync=lambda: synced.append("sync"))
    hb.begin_step(5)
    hb.enter("forward")
    with caplog.at_level(logging.INFO, logger="pdserve.engine.parallel.watchdog"):
        synced.clear()
        with hb.capturing():
            hb.enter("all_reduce")
            hb.enter("forward")
        assert synced == []
        with hb.replaying(4):
            hb.enter("all_reduce")
        assert len(synced) == 2                     # the phase before the replay ends; the replay ends
    assert "rank 1 (tp 1, pp 0) step 5: device synchronised after graph replay (bucket 4)" in caplog.text
    hb.close()


def test_the_report_says_which_ranks_wait_in_a_replay(heartbeat_fd):
    ranks = [RankInfo(0, 0, 0), RankInfo(1, 1, 0)]
    hb0, hb1 = Heartbeat(heartbeat_fd, 0), Heartbeat(heartbeat_fd, 1)
    for hb in (hb0, hb1):
        hb.begin_step(4)
    with hb0.replaying(2):
        hb1.enter("forward")
        report = Watchdog(Heartbeat(heartbeat_fd), ranks, timeout=0.0).check(time.monotonic() - 1)
    assert report.startswith("rank 1 (tp 1, pp 0) stalled in step 4 at phase forward")
    assert report.endswith("rank 0 is waiting in graph replay (bucket 2)")


# -- real CPU ranks through the replay path ----------------------------------------------------------------------

def make_engine(model_dir, tp: int, pp: int, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
                       execution=ExecutionConfig(enforce_eager=kw.pop("enforce_eager", False),
                                                 attention_backend=kw.pop("attention_backend", None)),
                       parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw))
    return LLMEngine(cfg)


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    vocab = hf_model(tiny_llama).config.vocab_size
    return [random_prompt(vocab, n, seed=n) for n in (1, 17, 60, 5)]


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    ref = hf_model(tiny_llama)
    return [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]


@pytest.fixture()
def stand_in(monkeypatch):
    monkeypatch.setenv("PDSERVE_RANK_GRAPHS_CPU", "1")             # the ranks' launcher inherits it


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
def test_the_replayed_stage_function_gives_tp1_and_hf_greedy_ids(tiny_llama, prompts, expected, stand_in, capfd,
                                                                 tp, pp):
    engine = make_engine(tiny_llama, tp, pp, debug_sync=True)      # debug-sync: every phase change is logged
    try:
        assert run(engine, prompts, GREEDY) == expected
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert err.count("decode graphs (CPU ranks: the stage function CUDA ranks capture") == tp * pp
    bucket = 4 // pp                            # 4 decoding rows, cut into pp micro-batches
    for rank in range(tp * pp):                 # every rank replayed
        assert any(f"rank {rank} (tp {rank % tp}, pp {rank // tp}) step" in line
                   and f"-> graph replay (bucket {bucket})" in line for line in err.splitlines())
    assert "device synchronised after graph replay (bucket" in err
    replayed = [line for line in err.splitlines() if "graph replay (bucket" in line and "-> all_reduce" in line]
    assert not replayed                         # no collective phase is written inside a replay


def test_triton_steps_are_staged_straight_into_the_graph_buffers(tiny_llama, prompts, expected, stand_in,
                                                                 monkeypatch):
    """With the Triton backend (the interpreter on CPU) a rank's decode micro-batch is staged straight into its
    graphs' buffers (``GraphInputs.stage``, as on CUDA) instead of copied there: tp2 still gives HF's ids."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")                    # the ranks (new processes) run Triton on CPU
    engine = make_engine(tiny_llama, 2, 1, attention_backend="triton")
    try:
        got = run(engine, prompts[:3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    assert got == [e[:4] for e in expected[:3]]


def test_enforce_eager_turns_the_replay_path_off(tiny_llama, prompts, expected, stand_in, capfd):
    engine = make_engine(tiny_llama, 2, 1, enforce_eager=True, debug_sync=True)
    try:
        assert run(engine, prompts[:2], GREEDY) == expected[:2]
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert err.count("decode eager (--enforce-eager") == 2 and "graph replay" not in err


def _wait_between_steps(heartbeat, rank: int, limit_s: float = 10.0) -> None:
    """Until ``rank`` waits for the next step's scheduler output: stopped earlier, it would stall in the last step."""
    deadline = time.monotonic() + limit_s
    while heartbeat.states()[rank].phase != "recv_scheduler_output":
        assert time.monotonic() < deadline, heartbeat.states()[rank]
        time.sleep(0.005)


def test_a_rank_blocked_inside_a_replay_is_named_with_that_phase(tiny_llama, stand_in):
    """Stop rank 1 between steps; the next decode step's replay on rank 0 blocks in its first all-reduce (gloo
    waits on the host, as a replayed NCCL collective waits on the device): the heartbeat shows the replay phase and
    the watchdog's report names the stopped rank and rank 0 waiting in that replay."""
    engine = make_engine(tiny_llama, 2, 1, rank_timeout=1.5)
    ex = engine.runner
    engine.add_request("r0", random_prompt(500, 9, seed=3), SamplingParams(max_tokens=100, ignore_eos=True,
                                                                           temperature=0.0))
    try:
        for _ in range(3):                                          # the prefill and two decode steps
            engine.step()
        _wait_between_steps(ex.heartbeat, 1)        # rank 1 may still be leaving step 3's all-gather (CI flake)
        pid = ex.heartbeat.states()[1].pid
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RankFailedError) as err:
            engine.step()
        state = ex.heartbeat.states()[0]                            # frozen: the ranks are stopped now
    finally:
        engine.shutdown()
    message = str(err.value)
    assert state.phase == "graph replay (bucket 1)" and f"in step {state.step}" in message
    assert "rank 1 (tp 1, pp 0) stalled" in message and "(process stopped)" in message
    assert "rank 0 is waiting in graph replay (bucket 1)" in message
