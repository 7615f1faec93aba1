"""The rank -> device / backend rule (``engine/parallel/devices.py``), every branch, and the pieces of the GPU
path that run on a CPU: --debug-sync's synchronise-and-log at each phase end, --dist-backend in the config."""

from __future__ import annotations

import itertools
import logging

import pytest

from pdserve.engine.config import ConfigError, EngineConfig, ParallelConfig
from pdserve.engine.parallel.devices import DeviceChoice, DeviceSelectionError, local_rank_of, select_device
from pdserve.engine.parallel.watchdog import Heartbeat


def test_cpu_ranks_use_gloo_whatever_the_layout():
    for per_node, visible in itertools.product((1, 2, 8), (0, 1, 8)):
        for local in range(per_node):
            for requested in ("auto", "gloo"):
                assert select_device("cpu", per_node, local, visible, requested) == \
                    DeviceChoice("cpu", None, "gloo", "CPU ranks: gloo")


def test_cpu_refuses_nccl():
    with pytest.raises(DeviceSelectionError, match="--dist-backend nccl needs --device cuda"):
        select_device("cpu", 2, 0, 0, "nccl")


@pytest.mark.parametrize("per_node, visible", [(1, 1), (2, 2), (2, 8), (4, 4), (8, 8)])
def test_one_gpu_per_rank_binds_the_local_rank_and_uses_nccl(per_node, visible):
    seen = set()
    for local in range(per_node):
        for requested in ("auto", "nccl"):
            c = select_device("cuda", per_node, local, visible, requested)
            assert (c.device, c.index, c.backend, c.shared) == (f"cuda:{local}", local, "nccl", False)
            assert f"{per_node} rank(s) on this machine, {visible} visible GPU(s)" in c.reason
        seen.add(c.index)
    assert seen == set(range(per_node))              # no two ranks on one GPU


def test_gloo_asked_with_one_gpu_per_rank_keeps_the_binding():
    c = select_device("cuda", 4, 3, 4, "gloo")
    assert (c.device, c.index, c.backend, c.shared) == ("cuda:3", 3, "gloo", True)
    assert "as asked" in c.reason


@pytest.mark.parametrize("per_node, visible", [(2, 1), (4, 1), (4, 2), (8, 3)])
def test_fewer_gpus_than_ranks_share_them_round_robin_over_gloo(per_node, visible):
    counts = [0] * visible
    for local in range(per_node):
        for requested in ("auto", "gloo"):
            c = select_device("cuda", per_node, local, visible, requested)
            assert (c.index, c.backend, c.shared) == (local % visible, "gloo", True)
            assert c.device == f"cuda:{local % visible}"
            assert "share" in c.reason and f"rank {local} on GPU {local % visible}" in c.reason
        counts[c.index] += 1
    assert max(counts) - min(counts) <= 1             # spread evenly


@pytest.mark.parametrize("per_node, visible", [(2, 1), (8, 7)])
def test_nccl_asked_with_a_shared_gpu_is_refused_naming_the_layout(per_node, visible):
    with pytest.raises(DeviceSelectionError, match=f"{per_node} rank.*{visible} visible GPU.*CUDA_VISIBLE_DEVICES"):
        select_device("cuda", per_node, 0, visible, "nccl")


def test_no_visible_gpu_is_refused():
    for requested in ("auto", "nccl", "gloo"):
        with pytest.raises(DeviceSelectionError, match="CUDA_VISIBLE_DEVICES"):
            select_device("cuda", 2, 1, 0, requested)


@pytest.mark.parametrize("args, match", [
    (("cuda", 2, 0, 2, "mpi"), "--dist-backend must be one of auto, nccl, gloo, got 'mpi'"),
    (("cuda", 2, 2, 2, "auto"), r"local rank 2 is outside \[0, 2\)"),
    (("cuda", 2, -1, 2, "auto"), "local rank -1"),
    (("cuda", 0, 0, 2, "auto"), "outside"),
    (("xpu", 1, 0, 1, "auto"), "cpu or cuda, got 'xpu'"),
])
def test_bad_inputs_are_refused(args, match):
    with pytest.raises(DeviceSelectionError, match=match):
        select_device(*args)


def test_config_accepts_cuda_with_ranks_and_checks_the_backend_flag(tmp_path):
    cfg = EngineConfig(model=str(tmp_path), device="cuda",
                       parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, debug_sync=True))
    assert cfg.parallel.dist_backend == "auto"
    with pytest.raises(ConfigError, match="--dist-backend must be auto, nccl or gloo, got 'mpi'"):
        ParallelConfig(tensor_parallel_size=2, dist_backend="mpi")
    with pytest.raises(ConfigError, match="--dist-backend nccl needs --device cuda"):
        EngineConfig(model=str(tmp_path), device="cpu",
                     parallel=ParallelConfig(tensor_parallel_size=2, dist_backend="nccl"))


def test_debug_sync_synchronises_as_each_phase_ends_and_logs_it(caplog):
    fd = Heartbeat.create(2)
    synced = []
    hb = Heartbeat(fd, rank=1, log_phases=True, coords="tp 1, pp 0", sync=lambda: synced.append(hb.states()[1].phase))
    caplog.set_level(logging.INFO, logger="pdserve.engine.parallel.watchdog")
    hb.begin_step(7)
    for phase in ("recv_scheduler_output", "forward", "all_reduce", "forward", "sample"):
        hb.enter(phase)
    # the sync runs before the new phase is recorded: a rank stuck in it shows the phase whose work it drains
    assert synced == ["starting", "recv_scheduler_output", "forward", "all_reduce", "forward"]
    lines = [r.getMessage() for r in caplog.records if "device synchronised" in r.getMessage()]
    assert lines[2] == "rank 1 (tp 1, pp 0) step 7: device synchronised after forward"
    assert lines[3] == "rank 1 (tp 1, pp 0) step 7: device synchronised after all_reduce"
    hb.close()


def test_without_debug_sync_nothing_synchronises(caplog):
    fd = Heartbeat.create(1)
    hb = Heartbeat(fd, rank=0)
    caplog.set_level(logging.INFO, logger="pdserve.engine.parallel.watchdog")
    hb.enter("forward")
    assert not [r for r in caplog.records if "synchronised" in r.getMessage()]
    hb.close()


def test_the_local_rank_is_the_index_on_the_machine():
    # tp 4 x pp 4 over 2 machines of 8 GPUs: ranks 8-15 on machine 1 bind its GPUs 0-7
    assert [local_rank_of(r, 8) for r in range(16)] == [*range(8), *range(8)]
    assert select_device("cuda", 8, local_rank_of(13, 8), 8).device == "cuda:5"


def test_a_cpu_rank_binds_nothing_and_logs_its_choice(caplog):
    from pdserve.engine.parallel import messages as m
    from pdserve.engine.parallel.worker import bind_device, device_sync

    spec = m.WorkerSpec(model="x", dtype="float32", seed=0, tp=2, pp=2, num_blocks=4, block_size=8, broadcast={},
                        results={}, kv_parts=[], heartbeat_mirror={}, local_ranks=[0, 1], rank_timeout=1.0)
    caplog.set_level(logging.INFO, logger="pdserve.worker")
    for rank in range(4):
        assert bind_device(spec, rank) == DeviceChoice("cpu", None, "gloo", "CPU ranks: gloo")
    assert "rank 3: cpu, gloo (CPU ranks: gloo)" in caplog.text
    assert device_sync(DeviceChoice("cpu", None, "gloo", ""))() is None
    with pytest.raises(DeviceSelectionError, match="nccl needs --device cuda"):
        bind_device(m.WorkerSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "dist_backend": "nccl"}), 0)
