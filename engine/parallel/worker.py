"""One TP x PP worker rank: ``run_rank(master_addr, master_port, rank)``.

Called in a process forked for the rank by ``launcher.py`` (started by ``ParallelExecutor``).
Start-up, in order:

    store client (FileStore in the node's 0700 dir; TCPStore with --nnodes > 1) -> WorkerSpec (JSON,
    "pdserve/spec") -> the rank's device and backend (``devices.py``: CPU + gloo; one GPU per rank + nccl;
    ranks sharing a GPU + gloo), the GPU bound -> heartbeat "starting" -> the backend agreed by every rank
    (each publishes its own under "pdserve/backend/<rank>"; one machine sharing GPUs puts every rank on gloo)
    torch.distributed (that backend) over the same store; one TP group per pipeline stage
    load this rank's layers and heads (safetensors slices); allocate its KV cache shard
    decode graphs (``graphs.py``): nccl ranks capture their stage per batch bucket (warm-up, one pool); gloo,
    CPU and --enforce-eager ranks run eager (each logs which and why)
    store.add("pdserve/ready", 1)

Then the loop, one ``StepMessage`` from the broadcast queue at a time (heartbeat phases in brackets):

    [recv_scheduler_output] msg = queue.dequeue()     Shutdown -> exit 0; the driver gone -> exit 1
    KVGather / KVScatter   [kv_save / kv_load]        copy this rank's layers and heads (parallel/kv.py);
                                                      an error is the reply's ``error``, never the rank's end
    stage.execute(msg)     [recv_from_prev_stage, forward, all_reduce, graph replay (bucket b), send_to_next_stage,
                           sample]
    last stage, tp rank 0: results.enqueue(StepResult)

Rank r has coordinates tp = r % T, pp = r // T. Every process uses one torch thread.

Who judges a stall: only the driver's watchdog, from heartbeats. The rank's own waits never time out
on a live peer: its queue writes wait while the driver lives, and gloo's collective timeout
(``COLLECTIVE_TIMEOUT``) is a day, far beyond any --rank-timeout, so a stage waiting on a slow but
moving stage is never killed by gloo.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from pdserve.engine import host_memory
from pdserve.engine.models.loader import load_model
from pdserve.engine.parallel import faults
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.broadcast import MessageQueue, QueueHandle, WriterDeadError
from pdserve.engine.parallel.devices import DeviceChoice, agree, local_rank_of, select_device
from pdserve.engine.parallel.graphs import StageGraphs, rank_mode
from pdserve.engine.parallel.kv import gather_part, scatter_part
from pdserve.engine.parallel.stage import Coords, StageRunner, stage_layers
from pdserve.engine.parallel.tp import TPGroup, attach
from pdserve.engine.parallel.watchdog import Heartbeat
from pdserve.engine.runner.model_runner import ModelRunner

logger = logging.getLogger("pdserve.worker")
SPEC_KEY, READY_KEY, BACKEND_KEY = "pdserve/spec", "pdserve/ready", "pdserve/backend"
COLLECTIVE_TIMEOUT = timedelta(days=1)     # gloo's own give-up: a backstop only; stalls are the watchdog's call


def collective_timeout(rank_timeout: float) -> timedelta:
    """Far beyond the watchdog: the watchdog reports a stuck rank within --rank-timeout, gloo never first."""
    return max(COLLECTIVE_TIMEOUT, timedelta(seconds=100 * rank_timeout))


def connect_store(addr: str, port: int, timeout_s: float, store_file: str = "") -> dist.Store:
    """The driver's rendezvous: the FileStore at ``store_file`` (every rank on its machine), else its TCPStore."""
    if store_file:
        store = dist.FileStore(store_file, -1)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class Worker:
    def __init__(self, store: dist.Store, rank: int, heartbeat_fd: int):
        self.spec = msgspec.json.decode(store.get(SPEC_KEY), type=m.WorkerSpec)
        spec = self.spec
        self.coords = Coords(rank, rank % spec.tp, rank // spec.tp, spec.tp, spec.pp)
        local = rank in spec.local_ranks
        if spec.debug_sync:
            logging.getLogger("pdserve.engine.parallel.watchdog").setLevel(logging.INFO)
        self.choice = bind_device(spec, rank)
        self.heartbeat = Heartbeat(heartbeat_fd, rank, spec.debug_sync, str(self.coords),
                                   sync=device_sync(self.choice) if spec.debug_sync else None)
        self.choice = agree_backend(store, rank, spec.tp * spec.pp, self.choice)
        torch.manual_seed(spec.seed)
        dist.init_process_group(self.choice.backend, store=dist.PrefixStore("pdserve/pg", store), rank=rank,
                                world_size=spec.tp * spec.pp, timeout=collective_timeout(spec.rank_timeout))
        self.tp_group = self._tp_groups()[self.coords.pp]
        self.stage = self._load()
        handle = msgspec.convert(spec.broadcast, QueueHandle)
        self.inbox = MessageQueue.reader(handle, spec.local_ranks.index(rank) if local else -1)
        self.results = MessageQueue.writer(msgspec.convert(spec.results, QueueHandle)) if self.coords.samples else None
        self.kv_out = MessageQueue.writer(msgspec.convert(spec.kv_parts[rank], QueueHandle))
        store.add(READY_KEY, 1)
        logger.info("rank %d (%s) ready", rank, self.coords)

    def _tp_groups(self) -> list:
        t = self.spec.tp
        timeout = collective_timeout(self.spec.rank_timeout)       # new_group does not inherit it (gloo: 30 min)
        groups = [dist.new_group(list(range(p * t, (p + 1) * t)), timeout=timeout)
                  for p in range(self.spec.pp)]                                # all ranks, same order
        return [TPGroup(g, t, self.heartbeat, via_host=self.choice.shared) for g in groups]

    def _load(self) -> StageRunner:
        spec, c = self.spec, self.coords
        from pdserve.engine.models.model_config import ModelConfig

        num_layers = ModelConfig.from_dir(spec.model, dtype=spec.dtype).num_layers
        first, count = stage_layers(num_layers, spec.pp)[c.pp]
        faults.before_load()
        model, config = load_model(spec.model, spec.dtype, first_layer=first, num_layers=count,
                                   device=self.choice.device, tp_rank=c.tp, tp_size=c.tp_size)
        attach(model, self.tp_group)
        layout = config.kv_layout(num_kv_heads=config.num_kv_heads // c.tp_size, num_layers=count, first_layer=first)
        runner = ModelRunner(model, layout, spec.num_blocks, spec.block_size, device=self.choice.device,
                             max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                             attention_backend=spec.attention_backend)     # its own graphs off: the stage's below
        faults.install(model, c.rank, self.heartbeat)
        graphs = self._graphs(runner, config)                              # after the KV cache is allocated
        return StageRunner(model, runner, c, self.heartbeat, config.hidden_size, config.dtype,
                           via_host=self.choice.shared, graphs=graphs)

    def _graphs(self, runner, config) -> StageGraphs | None:
        """This rank's decode graphs (``graphs.py``): captured on nccl ranks, else None (eager); logged with why."""
        mode = rank_mode(self.choice, self.spec.enforce_eager, runner)
        logger.info("rank %d (%s): decode %s (%s)", self.coords.rank, self.coords,
                    "graphs" if mode.replays else "eager", mode.reason)
        if not mode.replays:
            return None
        return StageGraphs.build(runner, self.spec.max_model_len, self.heartbeat, config.hidden_size, config.dtype,
                                 self.coords.is_first, mode)

    def run(self) -> int:
        step = 0
        while True:
            self.heartbeat.begin_step(step + 1)
            self.heartbeat.enter("recv_scheduler_output")
            try:
                msg = m.decode_driver_message(self.inbox.dequeue())
            except WriterDeadError as exc:
                logger.error("rank %d (%s): %s; exiting", self.coords.rank, self.coords, exc)
                return 1
            if isinstance(msg, m.Shutdown):
                return 0
            if isinstance(msg, m.StepMessage):
                step = msg.step
                self.heartbeat.begin_step(step)
                self._step(msg)
            else:
                self._kv(msg)

    def _step(self, msg: m.StepMessage) -> None:
        for rid in msg.released:
            self.stage.runner.release(rid)
        tokens = self.stage.execute(msg)
        if self.results is not None:
            self.results.enqueue(m.encode(m.StepResult(msg.step, tokens or [])))

    def _kv(self, msg: m.KVGather | m.KVScatter) -> None:
        """Answer every KV op, an error included: a bad copy fails that chunk on the driver, not this rank."""
        runner, c = self.stage.runner, self.coords
        gather = isinstance(msg, m.KVGather)
        self.heartbeat.enter("kv_save" if gather else "kv_load")
        try:
            part = gather_part(runner, c.rank, msg, c.tp) if gather else scatter_part(runner, c.rank, c.tp, msg)
        except Exception as exc:  # noqa: BLE001 - reported to the driver in the reply
            logger.warning("rank %d (%s): KV %s op %d failed: %s: %s", c.rank, c, "gather" if gather else "scatter",
                           msg.op_id, type(exc).__name__, exc)
            part = m.KVPart(msg.op_id, c.rank, runner.layout.first_layer, error=f"{type(exc).__name__}: {exc}")
        self.kv_out.enqueue(m.encode(part))


def bind_device(spec: m.WorkerSpec, rank: int) -> DeviceChoice:
    """Pick this rank's device and backend (``devices.py``), bind the GPU, log why (once per rank)."""
    if spec.debug_sync and spec.device == "cuda":           # before the rank's first CUDA call, on every machine
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"            # (the driver's launcher env reaches its own machine only)
    per_node = len(spec.local_ranks)                        # every machine runs as many ranks as the driver's
    visible = torch.cuda.device_count() if spec.device == "cuda" else 0   # honours CUDA_VISIBLE_DEVICES
    choice = select_device(spec.device, per_node, local_rank_of(rank, per_node), visible, spec.dist_backend)
    if choice.index is not None:
        torch.cuda.set_device(choice.index)
    logger.info("rank %d: %s, %s (%s)", rank, choice.device, choice.backend, choice.reason)
    return choice


def agree_backend(store: dist.Store, rank: int, world_size: int, choice: DeviceChoice) -> DeviceChoice:
    """Publish this rank's backend, read every rank's (waits for them), -> the one all ranks use (``devices.agree``).
    Machines count their GPUs apart: without this, ranks with a GPU each would start nccl and ranks sharing one
    gloo, and ``init_process_group`` would hang. A rank that dies first is the driver's watchdog's to report."""
    store.set(f"{BACKEND_KEY}/{rank}", choice.backend)
    backends = [store.get(f"{BACKEND_KEY}/{r}").decode() for r in range(world_size)]
    agreed = agree(choice, backends)
    if agreed != choice:
        logger.info("rank %d: %s, %s (%s)", rank, agreed.device, agreed.backend, agreed.reason)
    return agreed


def device_sync(choice: DeviceChoice):
    """--debug-sync: the heartbeat calls this at every phase boundary (the CUDA_LAUNCH_BLOCKING analogue)."""
    if choice.index is None:
        return lambda: None                                 # CPU ops are synchronous already
    return torch.cuda.synchronize


def run_rank(master_addr: str, master_port: int, rank: int, heartbeat_fd: int,
             connect_timeout: float = 300.0, store_file: str = "") -> int:
    """A rank's whole life (called in the process forked for it by ``launcher.py``); -> exit code."""
    torch.set_num_threads(1)
    host_memory.tune()
    store = connect_store(master_addr, master_port, connect_timeout, store_file)
    worker = Worker(store, rank, heartbeat_fd)
    try:
        return worker.run()
    finally:
        dist.destroy_process_group()
