"""The driver side of a TP x PP node: start the ranks, broadcast each step, collect tokens, watch the ranks.

``LLMEngine`` uses it in place of ``ModelRunner`` when tp x pp > 1 (same calls, same results):

    executor = ParallelExecutor(config, model_config, num_blocks)   # starts the ranks, waits until all loaded
    sampled = executor.execute(scheduler_output)       # {request_id: SampleResult}; raises RankFailedError
    executor.release(request_id)                       # sampler state dropped with the next step
    executor.kv_io                                     # StoreConnector's publisher/loader (parallel/kv.py)
    executor.shutdown()                                # Shutdown message, then SIGKILL what is left

Start-up: the driver hosts the rendezvous ``TCPStore`` on --master-addr:--master-port, publishes
the ``WorkerSpec`` there (queue handles, heartbeat file), and starts its machine's ranks with
one ``python -m pdserve.engine.parallel.launcher`` (which forks one process per rank). The
watchdog thread checks every 0.2 s; on a report it kills every rank, and the waiting ``execute``
raises with the report. With --nnodes N the driver's machine runs ranks [0, W/N); ``pdserve node
--node-rank n`` on machine n runs the n-th slice (``launcher.launch``), mirrors their heartbeats
here and kills them when this executor reports a failure (``mirror.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch.distributed as dist

from pdserve.engine.models.llama import ShardSizes
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.broadcast import MessageQueue, QueueError
from pdserve.engine.parallel.channels import Channels
from pdserve.engine.parallel.kv import KVRelay
from pdserve.engine.parallel.mirror import FAILED_KEY, MirrorReceiver
from pdserve.engine.parallel.stage import stage_layers
from pdserve.engine.parallel.watchdog import Heartbeat, RankInfo, Watchdog
from pdserve.engine.parallel.worker import READY_KEY, SPEC_KEY
from pdserve.engine.sampler import SampleResult

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A worker rank exited or stalled; the message is the watchdog's report. Restart the node."""


class ParallelExecutor:
    kv_caches = None                      # the KV cache lives in the worker ranks

    def __init__(self, config, model_config, num_blocks: int, start_timeout: float = 600.0):
        par = config.parallel
        ShardSizes.for_tp(model_config, par.tensor_parallel_size)       # fail here, not in every rank
        stage_layers(model_config.num_layers, par.pipeline_parallel_size)
        self.config, self.par, self.step = config, par, 0
        self.failure: str | None = None          # the watchdog's report, set once every rank is gone
        self._report: str | None = None
        self._released: list[str] = []
        self._busy: dict[int, float] = {}          # waits in progress -> when they began
        self._busy_ids = itertools.count()
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._stopping = False
        self.store = dist.TCPStore(par.master_addr, par.master_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=start_timeout))
        local = list(range(par.ranks_per_node))                 # node 0's ranks; node n has the n-th slice
        self.ch = Channels.create(par.world_size, local, (par.pipeline_parallel_size - 1) * par.tensor_parallel_size,
                                  par.master_addr)
        self._hb_path = Heartbeat.create(par.world_size)
        self.heartbeat = Heartbeat(self._hb_path)
        self.outbox = MessageQueue.writer(self.ch.broadcast)
        self.inbox = Channels.read(self.ch.results)
        self.kv_io = KVRelay(self, {r: Channels.read(h) for r, h in enumerate(self.ch.kv_parts)},
                             model_config.num_layers, par.tensor_parallel_size)
        self.ranks = [RankInfo(r, r % par.tensor_parallel_size, r // par.tensor_parallel_size, r in local)
                      for r in range(par.world_size)]
        self.launcher = spawn_launcher(par.master_addr, self.store.port, local, self._hb_path, par.debug_sync)
        self.watchdog = Watchdog(self.heartbeat, self.ranks, par.rank_timeout, self.launcher)
        self._mirror = MirrorReceiver(self.ch.mirror, self.heartbeat, self.watchdog) if self.ch.mirror else None
        if self._mirror is not None:
            self._mirror.start()
        self.store.set(SPEC_KEY, msgspec.json.encode(self._spec(config, num_blocks, local)))
        atexit.register(self.shutdown)
        self._wait_ready(start_timeout)
        self._thread = threading.Thread(target=self._watch, name="pdserve-watchdog", daemon=True)
        self._thread.start()

    def _spec(self, config, num_blocks: int, local: list[int]) -> m.WorkerSpec:
        par = config.parallel
        return m.WorkerSpec(model=config.model, dtype=config.dtype, seed=config.seed, tp=par.tensor_parallel_size,
                            pp=par.pipeline_parallel_size, num_blocks=num_blocks, block_size=config.cache.block_size,
                            local_ranks=local, rank_timeout=par.rank_timeout, debug_sync=par.debug_sync,
                            **self.ch.spec_fields())

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.store.add(READY_KEY, 0) < self.par.world_size:
            report = self.watchdog.check(None)
            if report or time.monotonic() > deadline:
                self._fail(report or f"ranks did not start within {timeout:.0f}s: "
                                     f"{self.store.add(READY_KEY, 0)} of {self.par.world_size} ready")
                raise RankFailedError(f"starting the workers failed: {self.failure}")
            time.sleep(0.05)
        if self.ch.broadcast.num_remote_readers:
            self.outbox.wait_for_remote_readers(timeout)
        self._unlink_files()                # every process has them mapped: nothing to leak from here on
        logger.info("%d worker ranks ready (tp %d x pp %d): pids %s", self.par.world_size,
                    self.par.tensor_parallel_size, self.par.pipeline_parallel_size, self.rank_pids())

    def rank_pids(self) -> list[int]:
        """This machine's rank processes (the launcher's children, and any pid a local rank reported)."""
        reported = {s.pid for i, s in zip(self.ranks, self.heartbeat.states()) if i.local and s.pid}
        try:
            children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children").read_text().split()
        except OSError:
            children = []
        return sorted(reported | {int(c) for c in children})

    def pids(self) -> list[int]:
        """Every process this executor started: the ranks and their launcher."""
        return self.rank_pids() + [self.launcher.pid]

    # -- the engine thread ----------------------------------------------------------------------

    def execute(self, scheduler_output) -> dict[str, SampleResult]:
        self.raise_if_failed()
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return {}
        self.step += 1
        msg = m.StepMessage(self.step, [_step_request(i, self.config.cache.block_size) for i in scheduled],
                            released=self._released)
        self._released = []
        with self.busy():
            self.send(msg)
            result = self._wait_result()
        return {t.request_id: SampleResult(t.token_id, t.logprob, _tops(t.top_logprobs)) for t in result.tokens}

    def send(self, message) -> None:
        """Broadcast one driver message to every rank (any thread)."""
        data = m.encode(message)
        try:
            with self._send_lock:
                self.outbox.enqueue(data, timeout=self.par.rank_timeout)
        except QueueError as exc:
            self._fail(self.watchdog.check(self._busy_since()) or str(exc))
            raise RankFailedError(self._report) from None

    @contextlib.contextmanager
    def busy(self):
        """The driver waits on the ranks inside this block: the watchdog's stall clock runs."""
        token = next(self._busy_ids)
        self._busy[token] = time.monotonic()
        try:
            yield
        finally:
            del self._busy[token]

    def _busy_since(self) -> float | None:
        return min(self._busy.values(), default=None)

    def raise_if_failed(self) -> None:
        if self.failure:
            raise RankFailedError(self.failure)

    def _wait_result(self) -> m.StepResult:
        while True:
            data = self.inbox.dequeue(timeout=0.1)
            if data is not None:
                result = m.decode_result(data)
                if result.step != self.step:
                    raise QueueError(f"got the result of step {result.step} while waiting for step {self.step}")
                return result
            self.raise_if_failed()

    def release(self, request_id: str) -> None:
        self._released.append(request_id)

    # -- watchdog -------------------------------------------------------------------------------

    def _watch(self) -> None:
        while self._report is None and not self._stopping:
            report = self.watchdog.check(self._busy_since())
            if report:
                self._fail(report)
                return
            time.sleep(0.2)

    def _fail(self, report: str, log: bool = True) -> None:
        """Kill every rank, then publish ``failure`` (so a caller that sees it sees no rank left)."""
        with self._lock:
            if self._report is not None:
                return
            self._report = report
        if log:
            logger.error("%s; shutting down every rank", report)
            self.store.set(FAILED_KEY, report)             # launchers on other machines kill their ranks
        self._kill_all()
        self.failure = report

    # -- teardown -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask every rank to exit, then kill any that did not within 10 s; remove the shared files."""
        self._stopping = True
        if self._report is None:
            try:
                self.outbox.enqueue(m.encode(m.Shutdown("driver shutdown")), timeout=2.0)
                self.launcher.wait(timeout=10)
            except (QueueError, subprocess.TimeoutExpired):
                pass
        self._fail("the executor was shut down", log=False)

    def _kill_all(self) -> None:
        for pid in self.rank_pids():
            _kill(pid)                                     # SIGKILL also ends a SIGSTOPped rank
        try:
            self.launcher.wait(timeout=10)                 # it exits once it reaped every rank
        except subprocess.TimeoutExpired:
            _kill(self.launcher.pid)
            self.launcher.wait()
        self._unlink_files()
        if self._mirror is not None:
            self._mirror.stop.set()

    def _unlink_files(self) -> None:
        self.ch.close()
        try:
            os.unlink(self._hb_path)
        except FileNotFoundError:
            pass


def spawn_launcher(master_addr: str, master_port: int, ranks: list[int], heartbeat: str,
                   debug_sync: bool = False) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if debug_sync:
        env["CUDA_LAUNCH_BLOCKING"] = "1"                 # every kernel synchronous, errors at their call site
    cmd = [sys.executable, "-m", "pdserve.engine.parallel.launcher", "--master-addr", master_addr,
           "--master-port", str(master_port), "--ranks", ",".join(map(str, ranks)), "--heartbeat", heartbeat]
    return subprocess.Popen(cmd, env=env)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _step_request(item, block_size: int) -> m.StepRequest:
    req, start, n = item.request, item.first_token_index, item.num_new_tokens
    tokens = req.all_token_ids[start:start + n]
    blocks = req.block_ids[: (start + n + block_size - 1) // block_size]
    if not item.samples:
        return m.StepRequest(req.request_id, tokens, start, blocks, False)
    params = req.sampling_params
    history = list(req.all_token_ids) if params.repetition_penalty != 1.0 else None
    return m.StepRequest(req.request_id, tokens, start, blocks, True, params, history,
                         list(req.banned_token_ids), req.sampler_draws)


def _tops(tops):
    return None if tops is None else [tuple(t) for t in tops]
