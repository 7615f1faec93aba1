"""Review of decode graphs on TP x PP ranks (``engine/parallel/graphs.py``): reproductions of what broke, and guards.

- the function CUDA ranks capture (``StageGraphs._forward``, TP-wired, first and later stages, the Triton path with
  the fused norm / rope the GPU runs) makes no device -> host sync (``host_sync_guard.py``, a CPU stand-in for
  ``torch.cuda.set_sync_debug_mode``): a sync raises inside ``torch.cuda.graph`` on the first CUDA run;
- a rank whose graphs could not be built (``StageGraphs.build`` -> None: another attention backend, dynamic RoPE)
  says "decode eager", never "decode graphs (nccl": ``gpu_parallel_check.sh graphs`` counts that line as proof
  that both ranks replayed;
- ``gpu_parallel_check.sh graphs``: FAIL when the ids differ, when a rank did not log "decode graphs (", on CUDA
  when a rank did not log "decode graphs: captured"; SKIP (never PASS) when the part exits 3 (under 2 GPUs);
- seeded, penalised, top-k / top-p and logprob requests in padded replays (tp2: bucket 8 for 5 rows; pp2: two
  micro-batches) get the eager run's ids and logprobs, bit for bit (CPU stand-in).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.parallel.devices import DeviceChoice

HERE = Path(__file__).resolve().parent
NCCL = DeviceChoice("cuda:0", 0, "nccl", "one GPU per rank")


# -- no host sync inside the captured function -------------------------------------------------------------------

def captured_function_syncs(model_dir: str) -> dict:
    """(run in a fresh process, TRITON_INTERPRET=1) {stage: [syncs]} of ``StageGraphs._forward`` on tp rank 0 of 2
    (a 1-rank gloo group stands in for the TP group: shapes and code paths of tp2, not its values), for the first
    stage of pp2 (embedding, vocab-parallel) and the last (hidden_in), plus two planted syncs the guard must see."""
    import torch.distributed as dist

    from host_sync_guard import HostSyncGuard
    from pdserve.engine.models.loader import load_model
    from pdserve.engine.parallel.graphs import StageGraphs
    from pdserve.engine.parallel.tp import TPGroup, attach
    from pdserve.engine.parallel.watchdog import Heartbeat
    from pdserve.engine.runner.model_runner import ModelRunner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fd = Heartbeat.create(1)
    hb = Heartbeat(fd, 0)
    found = {}
    for first, count in ((0, 1), (1, 1)):
        model, config = load_model(model_dir, "float32", first_layer=first, num_layers=count, tp_rank=0, tp_size=2)
        attach(model, TPGroup(dist.group.WORLD, 2, hb))
        layout = config.kv_layout(num_kv_heads=config.num_kv_heads // 2, num_layers=count, first_layer=first)
        runner = ModelRunner(model, layout, 16, 8, max_num_seqs=4, max_model_len=64, attention_backend="triton")
        graphs = StageGraphs(runner, 64, hb, config.hidden_size, config.dtype, first == 0, captured=True)
        guard = HostSyncGuard()
        with torch.inference_mode(), hb.capturing(), guard:
            out = graphs._forward(4)
        assert out.shape == (4, config.hidden_size)
        found[f"stage {first}"] = guard.syncs
        planted = HostSyncGuard()
        with torch.inference_mode(), planted:
            int(graphs.seq_lens[:4].max())
            graphs.positions[:4].tolist()
        found[f"planted {first}"] = planted.syncs
    return found


def test_the_captured_stage_function_makes_no_host_sync(tiny_llama):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PDSERVE_FUSED_NORM="1", PDSERVE_FUSED_ROPE="1")
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import test_review_graphs as t; "
            f"print('SYNCS', json.dumps(t.captured_function_syncs({str(tiny_llama)!r})))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SYNCS "))[6:])
    for stage in (0, 1):
        assert len(found[f"planted {stage}"]) == 2, found            # the guard sees an item() and a tolist()
        assert found[f"stage {stage}"] == [], found[f"stage {stage}"]


# -- the rank's log says what it runs -----------------------------------------------------------------------------

def test_a_rank_whose_graphs_were_not_built_does_not_log_decode_graphs(tiny_llama, caplog):
    """nccl ranks with another attention backend: ``StageGraphs.build`` returns None (eager). The rank's one line
    must then say "decode eager", so that ``gpu_parallel_check.sh graphs`` (which counts "decode graphs (nccl"
    lines) cannot PASS comparing eager with eager."""
    from pdserve.engine.models.loader import load_model
    from pdserve.engine.parallel import messages as m
    from pdserve.engine.parallel.stage import Coords
    from pdserve.engine.parallel.worker import Worker
    from pdserve.engine.runner.model_runner import ModelRunner

    model, config = load_model(str(tiny_llama), "float32")
    runner = ModelRunner(model, config.kv_layout(), 16, 8, max_num_seqs=4, max_model_len=64,
                         attention_backend="torch")
    worker = Worker.__new__(Worker)                                 # the rank's state _graphs reads, no process group
    worker.choice, worker.coords = NCCL, Coords(0, 0, 0, 2, 1)
    worker.spec = m.WorkerSpec(str(tiny_llama), "float32", 0, 2, 1, 16, 8, {}, {}, [{}, {}], {}, [0, 1], 5.0,
                               attention_backend="torch", device="cuda", max_num_seqs=4, max_model_len=64)
    worker.heartbeat = None
    with caplog.at_level(logging.INFO, logger="pdserve"):
        graphs = worker._graphs(runner, config)
    assert graphs is None
    lines = [r.getMessage() for r in caplog.records if "decode" in r.getMessage()]
    assert not any("decode graphs (nccl" in line for line in lines), lines
    assert any("rank 0 (" in line and "decode eager (nccl, but attention backend torch" in line
               for line in lines), lines


# -- gpu_parallel_check.sh, part graphs: what its verdict rests on --------------------------------------------------

ROOT = HERE.parent
FAKE_PART = """#!/bin/bash
# stands in for `python3 -P devbench/parallel_check.py graphs ...`: prints $FAKE_OUT, exits $FAKE_RC
printf '%b' "$FAKE_OUT"; exit $FAKE_RC
"""


def _graphs_verdict(tmp_path, out: str, rc: int, small: str = "1") -> tuple[int, str]:
    """Run the script's graphs part with the part's process replaced (its log text and exit status given)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python3").write_text(FAKE_PART)
    (bindir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SMALL=small, PARTS="graphs",
               OUT=str(tmp_path / "out"), FAKE_OUT=out, FAKE_RC=str(rc))
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_parallel_check.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, (tmp_path / "out/summary.txt").read_text().splitlines()[-1]


CPU_MODE = "rank 0 (tp 0, pp 0): decode graphs (CPU ranks: the stage function CUDA ranks capture runs ...)\\n"
NCCL_MODE = "rank 0 (tp 0, pp 0): decode graphs (nccl: ...)\\n"
CAPTURED = "decode graphs: captured 4 stage graphs (batch 1..8) in 1.0 s, 3.0 MiB of graph memory\\n"
SYNCED = "rank 0 (tp 0, pp 0) step 3: device synchronised after graph replay (bucket 8)\\n"
PASSED = "PASS  tp2 graphs == eager == HF fp32     == eager: True; == HF: True\\ndecode step median: ratio 0.50 (x)\\n"


def test_gpu_check_graphs_part_passes_only_on_equal_ids_and_both_ranks_replaying(tmp_path):
    """Two graph runs (plain, --debug-sync) of two ranks each: 4 mode lines (4 captures on CUDA), synced replays."""
    rc, line = _graphs_verdict(tmp_path, CPU_MODE * 4 + SYNCED + PASSED, 0)
    assert rc == 0 and " PASS " in line and "4 rank logs" in line
    rc, line = _graphs_verdict(tmp_path, CPU_MODE * 4 + SYNCED + "FAIL  tp2 graphs == eager  == eager: False\\n", 1)
    assert rc == 1 and "FAIL (rc 1)" in line                          # ids differ
    rc, line = _graphs_verdict(tmp_path, SYNCED + PASSED, 0)
    assert rc == 1 and "FAIL (rc 1)" in line and "0 rank logs" in line    # no rank said it replays
    rc, line = _graphs_verdict(tmp_path, CPU_MODE * 3 + SYNCED + PASSED, 0)
    assert rc == 1 and "FAIL" in line                                  # one rank of four did not
    rc, line = _graphs_verdict(tmp_path, CPU_MODE * 4 + PASSED, 0)
    assert rc == 1 and "FAIL" in line and "0 replays synced" in line   # --debug-sync never synchronised a replay
    rc, line = _graphs_verdict(tmp_path, "SKIP  decode graphs on TP need >= 2 GPUs (NCCL, a GPU per rank): 1\\n", 3)
    assert " SKIP " in line and "PASS" not in line and "need >= 2 GPUs" in line
    # on CUDA every rank must also have captured (a rank that chose graphs but built none ran eagerly)
    rc, line = _graphs_verdict(tmp_path, NCCL_MODE * 4 + SYNCED + PASSED, 0, small="0")
    assert rc == 1 and "FAIL" in line and "(0 captured" in line
    rc, line = _graphs_verdict(tmp_path, (NCCL_MODE + CAPTURED) * 4 + SYNCED + PASSED, 0, small="0")
    assert rc == 0 and " PASS " in line and "(4 captured" in line


# -- sampling features in a replayed (padded) decode step: the same bits as eager -------------------------------

def _sampled(model_dir, eager: bool, pp: int) -> dict:
    """5 requests (decode rows 5 -> bucket 8, 3 padding rows; pp2: micro-batches of 3 and 2 -> buckets 4 and 2),
    each with another sampling feature: seeded, penalties, top-k / top-p, logprobs -> {id: (ids, logprobs)}."""
    from pdserve.engine.config import CacheConfig, EngineConfig, ExecutionConfig, ParallelConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    from hf_reference import random_prompt

    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
                       execution=ExecutionConfig(enforce_eager=eager),
                       parallel=ParallelConfig(tensor_parallel_size=3 - pp, pipeline_parallel_size=pp))
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=11, logprobs=3),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(max_tokens=6, temperature=1.0, seed=5, repetition_penalty=1.3, top_k=5),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=6, temperature=0.7, seed=99, top_p=0.8, logprobs=0)]
    engine = LLMEngine(cfg)
    out: dict = {}
    try:
        for i, (n, sp) in enumerate(zip((1, 17, 9, 5, 3), params)):
            engine.add_request(f"r{i}", random_prompt(400, n, seed=n), sp)
        while engine.has_unfinished():
            for o in engine.step():
                ids, lps = out.setdefault(o.request_id, ([], []))
                ids += o.new_token_ids
                lps.append(repr(getattr(o, "new_logprobs", None) or getattr(o, "logprobs", None)))
    finally:
        engine.shutdown()
    return out


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_seeded_penalised_logprob_requests_get_eager_bits_through_padded_replays(tiny_llama, monkeypatch, pp):
    monkeypatch.setenv("PDSERVE_RANK_GRAPHS_CPU", "1")
    replayed, eager = _sampled(tiny_llama, False, pp), _sampled(tiny_llama, True, pp)
    assert replayed == eager
    assert all(any(lp != "None" for lp in lps) for rid, (ids, lps) in replayed.items() if rid != "r2")
