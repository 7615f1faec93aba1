"""Review of issue 41 (parallel ranks on GPUs): each test reproduces one finding, on CPU.

1. Machines choose their backend apart: one with a GPU per rank picks nccl, one whose ranks share GPUs gloo, and
   ``init_process_group`` with mixed backends hangs. The ranks now agree through the store (``agree_backend``).
2. ``--debug-sync`` set CUDA_LAUNCH_BLOCKING in the driver's launcher env only: ranks on ``--node-rank`` > 0
   machines ran without it. The rank sets it itself before its first CUDA call.
3. ``bench/gpu_parallel_check.sh``: a part over its limit was "stopped" by killing the background subshell that
   runs the ``py`` shell function; the python part under it lived on into the next parts.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.devices import agree, local_rank_of, select_device
from pdserve.engine.parallel.worker import agree_backend, bind_device

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw) -> m.WorkerSpec:
    base = dict(model="x", dtype="float32", seed=0, tp=2, pp=2, num_blocks=4, block_size=8, broadcast={}, results={},
                kv_parts=[], heartbeat_mirror={}, local_ranks=[0, 1], rank_timeout=1.0, device="cuda")
    return m.WorkerSpec(**{**base, **kw})


def _ranks_on_two_machines(store, gpus_per_machine: tuple[int, int], per_node: int = 2):
    """Every rank's final choice, as its worker makes it: select_device on its machine, then agree_backend (ranks as
    threads over one store, as processes would be)."""
    world = per_node * len(gpus_per_machine)
    out = [None] * world

    def rank(r):
        first = select_device("cuda", per_node, local_rank_of(r, per_node), gpus_per_machine[r // per_node])
        out[r] = agree_backend(store, r, world, first)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_machines_with_and_without_a_gpu_per_rank_agree_on_one_backend():
    # tp 2 x pp 2 over 2 machines: machine 0 has 2 GPUs (nccl on its own), machine 1 has 1 (its ranks share it)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    choices = _ranks_on_two_machines(store, (2, 1))
    assert {c.backend for c in choices} == {"gloo"}, [c.backend for c in choices]
    assert [c.device for c in choices] == ["cuda:0", "cuda:1", "cuda:0", "cuda:0"]   # each keeps its GPU
    assert all(c.shared for c in choices)            # so every collective and hand-off goes through the host
    assert "rank(s) [2, 3] on other machines share GPUs" in choices[0].reason


def test_machines_with_a_gpu_per_rank_keep_nccl():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    choices = _ranks_on_two_machines(store, (2, 4))
    assert [(c.device, c.backend) for c in choices] == [("cuda:0", "nccl"), ("cuda:1", "nccl")] * 2


def test_agree_is_the_identity_when_all_ranks_match():
    c = select_device("cuda", 2, 1, 2)
    assert agree(c, ["nccl", "nccl"]) is c
    g = select_device("cuda", 2, 1, 1)
    assert agree(g, ["nccl", "gloo"]) is g


def test_debug_sync_sets_cuda_launch_blocking_in_the_rank_itself(monkeypatch):
    # a rank on --node-rank 1 is forked by `pdserve node`, not by the driver's launcher: its env came from no one
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    seen = {}

    def device_count():
        seen["blocking"] = os.environ.get("CUDA_LAUNCH_BLOCKING")
        return 2

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("bound", i))
    choice = bind_device(_spec(debug_sync=True, local_ranks=[0, 1]), 3)     # machine 1's local rank 1
    assert (choice.device, choice.backend, seen["bound"]) == ("cuda:1", "nccl", 1)
    assert seen["blocking"] == "1"                       # set before the rank's first CUDA call


def test_without_debug_sync_the_rank_leaves_launch_blocking_alone(monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    assert bind_device(_spec(), 1).shared
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_part_over_its_limit_is_stopped_with_everything_under_it(tmp_path):
    """The script runs its parts through the ``py`` shell function: the part is a python under a subshell, hung
    (``signal.pause``: it waits for a signal that only the time limit sends)."""
    script = f"""
        source {ROOT}/bench/run_part.sh
        OUT={tmp_path}; PIDS=()
        py() {{ python3 -P "$@"; }}
        run_part hang 1 py -c "import os, signal; open('{tmp_path}/pid', 'w').write(str(os.getpid())); signal.pause()"
        echo "rc=$?"
    """
    start = time.monotonic()
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    pid = int((tmp_path / "pid").read_text())
    try:
        assert "rc=124" in out.stdout, out.stdout + out.stderr
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the timed-out part's python still runs"
        assert time.monotonic() - start < 10
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def test_a_failing_part_fails_the_script_and_its_summary(tmp_path):
    """SMALL=0 on a box without CUDA: the device part must fail, the summary say so, the exit status be 1."""
    if torch.cuda.is_available():
        pytest.skip("this box has a GPU: the device part passes here")
    env = {**os.environ, "OUT": str(tmp_path), "SMALL": "0", "PARTS": "device"}
    out = subprocess.run(["bash", str(ROOT / "bench/gpu_parallel_check.sh")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "device" in summary and "FAIL (rc 1)" in summary


def test_with_nccl_a_rank_hung_on_its_device_is_not_the_one_named():
    """4. docs claimed "the stuck (or stopped) peer is still the one named" for NCCL without --debug-sync. Only a
    stopped process is. tp2 x pp2, rank 1 (tp 1, pp 0) hung on its GPU, its host still running: NCCL calls return at
    once, so ranks 0, 1 and 3 finish step 5 on the host and wait for step 6; rank 2 blocks reading its samples (its
    recv from rank 0 never completes on the device). The watchdog names rank 2: the heartbeats cannot tell. The docs
    now say so (and point to --debug-sync, where the hung rank blocks at its own phase end)."""
    from pdserve.engine.parallel.watchdog import Heartbeat, RankInfo, Watchdog

    fd = Heartbeat.create(4)
    reader = Heartbeat(fd)
    ranks = [Heartbeat(fd, rank=r) for r in range(4)]
    for r, (step, phase) in enumerate([(6, "recv_scheduler_output"), (6, "recv_scheduler_output"), (5, "sample"),
                                       (6, "recv_scheduler_output")]):
        ranks[r].begin_step(step)
        ranks[r].enter(phase)
    dog = Watchdog(reader, [RankInfo(r, r % 2, r // 2) for r in range(4)], timeout=0.02)
    deadline, report = time.monotonic() + 5, None
    while report is None and time.monotonic() < deadline:
        report = dog.check(time.monotonic() - 1.0)
        time.sleep(0.01)
    assert report.startswith("rank 2 (tp 0, pp 1) stalled in step 5 at phase sample"), report
    assert "(process stopped)" not in report
    docs = (ROOT / "docs/parallel-nodes.md").read_text()
    assert "the stuck (or stopped) peer is still the one named" not in docs
    assert "hung on its device" in docs
    for h in (*ranks, reader):
        h.close()


def test_uneven_ranks_per_machine_are_refused_before_any_rank_starts():
    """local_rank_of assumes every machine runs tp x pp / nnodes ranks: a layout that does not divide is a config
    error (no finding; the attack that it would mis-bind GPUs does not get through)."""
    from pdserve.engine.config import ConfigError, ParallelConfig

    with pytest.raises(ConfigError, match="tp x pp = 3 ranks do not split evenly over --nnodes 2"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)
    assert [local_rank_of(r, 3) for r in range(6)] == [0, 1, 2, 0, 1, 2]
