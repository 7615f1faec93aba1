"""The driver side of a TP x PP node: start the ranks, broadcast each step, collect tokens, watch the ranks.

``LLMEngine`` uses it in place of ``ModelRunner`` when tp x pp > 1 (same calls, same results):

    executor = ParallelExecutor(config, model_config, num_blocks)   # starts the ranks, waits until all loaded
    sampled = executor.execute(scheduler_output)       # {request_id: SampleResult}; raises RankFailedError
    executor.release(request_id)                       # sampler state dropped with the next step
    executor.kv_io                                     # StoreConnector's publisher/loader (parallel/kv.py)
    executor.shutdown()                                # ranks exit in order; kills what did not

Start-up: the driver hosts the rendezvous store: with --nnodes 1 a ``FileStore`` in a 0700 directory
of its own (``file_store``: no other local user can read or write it), else a ``TCPStore`` listening
on --master-addr:--master-port only (``rendezvous_store``); it publishes the ``WorkerSpec`` there (queue
handles), and starts its machine's ranks with one ``python -m pdserve.engine.parallel.launcher``
(its own session; it forks one process per rank) that inherits the shared-memory rings and the
heartbeat as fds and the read end of a lifeline pipe. An exception or a signal during start-up
(``NodeStopped``) stops the launcher before it propagates. The watchdog thread checks every
0.2 s; on a report it stops every rank, and the waiting ``execute`` raises with the report.
With --nnodes N the driver's machine runs ranks [0, W/N); ``pdserve node --node-rank n`` on
machine n runs the n-th slice (``launcher.launch``), mirrors their heartbeats here and kills them
when this executor reports a failure (``mirror.py``).

Stopping: the driver signals no rank itself (a rank's pid may have been reaped and reused). It
closes the lifeline, and the launcher, the ranks' parent, kills those it has not reaped; only if
the launcher does not exit is it SIGKILLed (its own unreaped child), its ranks following by
``PR_SET_PDEATHSIG``. Every broadcast goes through ``send`` under one lock, ``shutdown`` included,
so no message interleaves with another's frames. A full ring never times out on its own: the
writer waits while the readers live, until the watchdog (heartbeats) reports.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import msgspec

from pdserve.engine.models.llama import ShardSizes
from pdserve.engine.parallel import faults  # noqa: F401 - a bad PDSERVE_FAULTS fails in the driver, not in every rank
from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.broadcast import MessageQueue, QueueError
from pdserve.engine.parallel.channels import Channels
from pdserve.engine.parallel.kv import KVRelay
from pdserve.engine.parallel.mirror import FAILED_KEY, MirrorReceiver
from pdserve.engine.parallel.rendezvous import file_store, remove_file_store, rendezvous_store, spawn_launcher
from pdserve.engine.parallel.stage import stage_layers
from pdserve.engine.parallel.watchdog import Heartbeat, RankInfo, Watchdog
from pdserve.engine.parallel.worker import READY_KEY, SPEC_KEY
from pdserve.engine.runner.sampler import SampleResult

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0                 # how long the launcher gets to exit before it is SIGKILLed


class RankFailedError(RuntimeError):
    """A worker rank exited or stalled; the message is the watchdog's report. Restart the node."""


class ParallelExecutor:
    kv_caches = None                      # the KV cache lives in the worker ranks

    def __init__(self, config, model_config, num_blocks: int, start_timeout: float = 600.0):
        par = config.parallel
        ShardSizes.for_tp(model_config, par.tensor_parallel_size)       # fail here, not in every rank
        stage_layers(model_config.num_layers, par.pipeline_parallel_size)
        self.config, self.par, self.step = config, par, 0
        self._max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        self.failure: str | None = None          # the watchdog's report, set once every rank is gone
        self._report: str | None = None
        self._released: list[str] = []
        self._busy: dict[int, float] = {}          # waits in progress -> when they began
        self._busy_ids = itertools.count()
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._stopping = False
        self._mirror = None
        if par.nnodes == 1:                                     # removed once the launcher is gone (_kill_all)
            self.store, self._store_file = file_store(start_timeout)
        else:
            self.store, self._store_file = rendezvous_store(par.master_addr, par.master_port, start_timeout), ""
        local = list(range(par.ranks_per_node))                 # node 0's ranks; node n has the n-th slice
        self.ch = Channels.create(par.world_size, local, (par.pipeline_parallel_size - 1) * par.tensor_parallel_size,
                                  par.master_addr)
        hb_fd = Heartbeat.create(par.world_size)
        self.heartbeat = Heartbeat(hb_fd)
        self.outbox = MessageQueue.writer(self.ch.broadcast)
        self.inbox = Channels.read(self.ch.results)
        self.kv_io = KVRelay(self, {r: Channels.read(h) for r, h in enumerate(self.ch.kv_parts)},
                             model_config.num_layers, par.tensor_parallel_size)
        self.ranks = [RankInfo(r, r % par.tensor_parallel_size, r // par.tensor_parallel_size, r in local)
                      for r in range(par.world_size)]
        try:
            self.launcher, self._lifeline = spawn_launcher(par.master_addr, 0 if self._store_file else self.store.port,
                                                           local, hb_fd, self.ch.fds(), par.debug_sync, par.nnodes == 1,
                                                           self._store_file)
        except BaseException:
            remove_file_store(self._store_file)
            raise
        finally:
            self.ch.release()                                   # the launcher holds them now (or nobody)
            os.close(hb_fd)
        self.watchdog = Watchdog(self.heartbeat, self.ranks, par.rank_timeout, self.launcher)
        try:
            self._start(config, num_blocks, local, start_timeout)
        except BaseException:                                   # a failed start, or a signal (NodeStopped)
            self._fail("start-up was interrupted", log=False)
            raise
        atexit.register(self.shutdown)
        self._thread = threading.Thread(target=self._watch, name="pdserve-watchdog", daemon=True)
        self._thread.start()

    def _start(self, config, num_blocks: int, local: list[int], start_timeout: float) -> None:
        if self.ch.mirror:
            self._mirror = MirrorReceiver(self.ch.mirror, self.heartbeat, self.watchdog)
            self._mirror.start()
        self.store.set(SPEC_KEY, msgspec.json.encode(self._spec(config, num_blocks, local)))
        self._wait_ready(start_timeout)

    def _spec(self, config, num_blocks: int, local: list[int]) -> m.WorkerSpec:
        par = config.parallel
        return m.WorkerSpec(model=config.model, dtype=config.dtype, seed=config.seed, tp=par.tensor_parallel_size,
                            pp=par.pipeline_parallel_size, num_blocks=num_blocks, block_size=config.cache.block_size,
                            local_ranks=local, rank_timeout=par.rank_timeout, debug_sync=par.debug_sync,
                            attention_backend=config.execution.attention_backend, device=config.resolved_device,
                            dist_backend=par.dist_backend, max_num_seqs=config.scheduler.max_num_seqs,
                            max_model_len=self._max_model_len, enforce_eager=config.execution.enforce_eager,
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
        bitmask = getattr(scheduler_output, "grammar_bitmask", None)
        msg = m.StepMessage(self.step, [_step_request(i, self.config.cache.block_size, bitmask) for i in scheduled],
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
                self.outbox.enqueue(data, abort=lambda: self._report)    # a full ring waits for the watchdog
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
            if report and not self._stopping:               # ranks exit on purpose once shutdown began
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
        """Stop the ranks in order: a Shutdown message after any message in flight (under the send lock, so
        never inside a multi-frame KV scatter), every rank exits 0, then the launcher; kill what did not.
        Idempotent."""
        if self._report is None and self._send_lock.acquire(timeout=self.par.rank_timeout + 5):
            try:
                if self._report is None:
                    self._stopping = True                   # from here a rank's exit is no failure
                    self.outbox.enqueue(m.encode(m.Shutdown("driver shutdown")), timeout=self.par.rank_timeout)
                    self.launcher.wait(timeout=STOP_WAIT_S)
            except (QueueError, subprocess.TimeoutExpired) as exc:
                logger.warning("the ranks did not stop in order (%s); killing them", exc)
            finally:
                self._send_lock.release()
        self._fail("the executor was shut down", log=False)

    def _kill_all(self) -> None:
        """Close the lifeline: the launcher kills the ranks it has not reaped, reaps them and exits. If it does
        not, SIGKILL it (the only process the driver signals; its ranks die with it)."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        try:
            self.launcher.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.error("the rank launcher (pid %d) did not exit; killing it", self.launcher.pid)
            self.launcher.kill()
            self.launcher.wait()
        remove_file_store(self._store_file)                     # no rank is left to read it
        if self._mirror is not None:
            self._mirror.stop.set()


def _step_request(item, block_size: int, bitmask=None) -> m.StepRequest:
    req, start, n = item.request, item.first_token_index, item.num_new_tokens
    tokens = req.all_token_ids[start:start + n]
    blocks = req.block_ids[: (start + n + block_size - 1) // block_size]
    if not item.samples:
        return m.StepRequest(req.request_id, tokens, start, blocks, False)
    params = req.sampling_params
    history = list(req.all_token_ids) if params.repetition_penalty != 1.0 else None
    outputs = list(req.output_token_ids) if params.penalised else None
    return m.StepRequest(req.request_id, tokens, start, blocks, True, params, history,
                         list(req.banned_token_ids), req.sampler_draws, outputs,
                         None if bitmask is None else bitmask.row_bytes(req.request_id))


def _tops(tops):
    return None if tops is None else [tuple(t) for t in tops]
