"""Review of decode graphs on TP x PP ranks (``engine/parallel/graphs.py``): reproductions of what broke, and guards.

- the function CUDA ranks capture (``StageGraphs._forward``, TP-wired, first and later stages, the Triton path with
  the fused norm / rope the GPU runs) makes no device -> host sync (``host_sync_guard.py``, a CPU stand-in for
  ``torch.cuda.set_sync_debug_mode``): a sync raises inside ``torch.cuda.graph`` on the first CUDA run;
- a rank whose graphs could not be built (``StageGraphs.build`` -> None: another attention backend, dynamic RoPE)
  says "decode eager", never "decode graphs (nccl": ``gpu_parallel_check.sh graphs`` counts that line as proof
  that both ranks replayed.
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
