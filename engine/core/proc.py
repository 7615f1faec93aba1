"""The engine-core process: ``LLMEngine`` in a loop of receive -> schedule/execute/update -> send; no HTTP.

    python -m pdserve.engine.core.proc       (started by ``EngineCoreClient``; StartCore on stdin)

One turn of the loop:

    0. connect   (once) DEALERs to the API process's "down" and "up" sockets, a Hello with StartCore's token first
    1. receive   every AddRequest / AbortRequests / Shutdown that arrived (block up to IDLE_POLL_S when idle);
                 a frame that does not decode is dropped and counted, never fatal
    2. apply     add_request (a refusal becomes a ``Rejected``), abort_request, stop_request (a stop string
                 the API process found, also in the prefill node's first token of an add: the final output
                 follows in this turn's CoreOutputs)
    3. check     a dead or stalled tp x pp rank: send Fatal, exit 1
    4. step      LLMEngine.step() when anything is unfinished; an exception escaping it: Fatal, exit 1
    5. send      one CoreOutputs: the step's deltas (each with its add's ``seq``), the refusals, stats when due

Beside the loop, a heartbeat thread sends ``Heartbeat`` every HEARTBEAT_S through the same socket (one
lock): a step longer than --rank-timeout is not a hang; a stopped or GIL-wedged process is.

Shutdown: ``LLMEngine.shutdown`` (KV publisher flushed, store closed, ranks stopped in order), exit 0.
The process ignores SIGINT / SIGTERM (the API process decides when to stop it) and dies with the API
process: PR_SET_PDEATHSIG, and EOF on stdin (the lifeline) ends it at once.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time

import zmq

from pdserve.engine import envs
from pdserve.engine.core import channel
from pdserve.engine.core import messages as m
from pdserve.engine.parallel import faults

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.5                 # how often an idle core checks its ranks and reports stats
_PR_SET_PDEATHSIG = 1


class Outbox:
    """The "up" socket to the API process, shared by the loop and the heartbeat thread (zmq sockets are
    not thread-safe: one lock)."""

    def __init__(self, sock: zmq.Socket):
        self.sock, self._lock = sock, threading.Lock()

    def send(self, message) -> None:
        data = m.encode(message)
        with self._lock:
            self.sock.send(data)


class Heartbeat:
    """A thread that sends ``Heartbeat`` every HEARTBEAT_S until ``stop()``."""

    def __init__(self, outbox: Outbox):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(outbox,), name="pdserve-core-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _beat(self, outbox: Outbox) -> None:
        while not self._stopped.wait(m.HEARTBEAT_S):
            outbox.send(m.Heartbeat())


class CoreLoop:
    """Steps one ``LLMEngine`` for the messages on ``inbox``; answers on ``outbox``."""

    def __init__(self, engine, inbox: zmq.Socket, outbox: Outbox):
        from pdserve.engine.kv.kv_transfer import KVTransferParams
        from pdserve.kvstore.stats_cache import StatsCache

        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._transfer = KVTransferParams
        self.store_stats = StatsCache(engine.store) if engine.store is not None else None
        self._stats_at = 0.0
        self._seqs: dict[str, int] = {}        # live request id -> the seq of the add that started it
        self._stopped: dict[str, int] = {}     # id -> seq of an add a StopRequests ended, its final not sent yet
        self.drops = channel.Drops("engine core", logger)   # frames from the API process that did not decode

    def run(self) -> int:
        """-> the exit code: 0 after Shutdown, 1 after a Fatal."""
        while True:
            code = self.turn()
            if code is not None:
                return code

    def turn(self) -> int | None:
        """One turn of the loop (the module docstring's steps 1-5): None, or the exit code when it must end.
        Every add that reached the socket before the step is applied before it (``_receive`` drains), so a
        burst's first step schedules all of the burst that has arrived; nothing waits for more."""
        rejected, stop = self._apply(self._receive())
        if stop:
            return 0
        failure = getattr(self.engine.runner, "failure", None)
        if failure is not None:                            # a tp x pp rank died or stalled, even while idle
            return self._fatal(f"engine stopped: {failure}")
        outputs = []
        if self.engine.has_unfinished():
            try:
                faults.before_core_step()
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - unrecoverable (LLMEngine.step isolated what it could)
                logger.exception("engine step failed beyond recovery")
                return self._fatal(f"engine step failed: {type(exc).__name__}: {exc}")
        self._send(outputs, rejected)
        return None

    def stats(self):
        from pdserve.engine.core.async_engine import collect_stats

        self._stats_at = time.monotonic()
        return collect_stats(self.engine, self.store_stats)

    def close(self) -> None:
        if self.store_stats is not None:
            self.store_stats.close()

    def _receive(self) -> list:
        timeout_ms = 0 if self.engine.has_unfinished() else int(IDLE_POLL_S * 1000)
        if not self.inbox.poll(timeout_ms):
            return []
        messages = []
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            msg = channel.decode_from_api(frames, self.drops)     # None: dropped, never fatal
            if msg is not None:
                messages.append(msg)

    def _apply(self, messages: list) -> tuple[list[m.Rejected], bool]:
        rejected = []
        for msg in messages:
            if isinstance(msg, m.Shutdown):
                logger.info("shutting down: %s", msg.reason or "asked by the API process")
                return rejected, True
            if isinstance(msg, m.AbortRequests):
                for request_id in msg.request_ids:
                    self.engine.abort_request(request_id)          # drops its pending outputs too
                    self._seqs.pop(request_id, None)
                    self._stopped.pop(request_id, None)
                continue
            if isinstance(msg, m.StopRequests):
                for request_id, stop_string in zip(msg.request_ids, msg.stop_strings):
                    self.engine.stop_request(request_id, stop_string)
                    if request_id in self._seqs:   # its final output keeps this seq, even if the id is re-added
                        self._stopped[request_id] = self._seqs.pop(request_id)   # before it is sent
                continue
            transfer = None if msg.kv_transfer_params is None else msg.kv_transfer_params.to_json_obj()
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, transfer, msg.cache_salt)
            except Exception as exc:  # noqa: BLE001 - the request's failure, reported to its caller
                rejected.append(m.Rejected(msg.request_id, msg.seq, type(exc).__name__, str(exc),
                                           isinstance(exc, ValueError)))
                continue
            self._seqs[msg.request_id] = msg.seq
            if msg.first_token_stop is not None:             # the API process found it in the prefill node's token
                self.engine.stop_request(msg.request_id, msg.first_token_stop)
        return rejected, False

    def _send(self, outputs: list, rejected: list[m.Rejected]) -> None:
        idle = not self.engine.has_unfinished()
        since = time.monotonic() - self._stats_at
        due = (idle and bool(outputs or rejected)) or since >= (IDLE_POLL_S if idle else m.STATS_INTERVAL_S)
        if not (outputs or rejected or due):
            return
        stats = self.stats() if due else None      # idle after outputs: the figures once the last request ended
        self.outbox.send(m.CoreOutputs([m.output_to_wire(o, self._seq(o)) for o in outputs], rejected, stats))

    def _seq(self, out) -> int:
        """The seq of ``out``'s add (-1, dropped by the client, for an id the core does not know). The next
        final output of a stopped id is the stopped add's (an add of the id in the same batch comes after)."""
        if out.finished:
            if out.request_id in self._stopped:
                return self._stopped.pop(out.request_id)
            return self._seqs.pop(out.request_id, -1)
        return self._seqs.get(out.request_id, -1)

    def _fatal(self, message: str) -> int:
        logger.error("%s; the engine core exits", message)
        self.outbox.send(m.Fatal(message))
        return 1


def serve(start: m.StartCore) -> int:
    """Connect to the API process (Hello first), build the engine, say Ready, loop until Shutdown or a fatal error."""
    from pdserve.engine.core.llm_engine import LLMEngine

    ctx = zmq.Context()
    faults.before_core_connect()
    inbox, up = channel.connect(ctx, start)
    outbox = Outbox(up)
    engine = loop = heartbeat = None
    try:
        engine = LLMEngine(start.config, detokenize=False)       # the API process detokenizes
        gc.freeze()                          # start-up objects (65k KV blocks...): never scanned again
        loop = CoreLoop(engine, inbox, outbox)
        outbox.send(m.Ready(os.getpid(), engine.max_model_len, engine.runtime.num_blocks, loop.stats(),
                            engine.store_info(), engine.kv_events_endpoint,
                            engine.kv_replay_endpoint))
        heartbeat = Heartbeat(outbox)
        return loop.run()
    except Exception as exc:  # noqa: BLE001 - a failed start (bad config, missing weights): tell the API why
        logger.exception("the engine core failed")
        outbox.send(m.Fatal(f"engine core failed: {type(exc).__name__}: {exc}"))
        return 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if loop is not None:
            loop.close()
        if engine is not None:
            engine.shutdown()
        ctx.destroy(linger=2000)


def _watch_lifeline(stream) -> None:
    """stdin's other end is held by the API process: EOF means it closed it or died. Leave at once
    (tp x pp ranks follow: their launcher's lifeline is this process)."""
    while stream.read(1):
        pass
    os._exit(1)


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):                        # not Linux: the lifeline still ends us
        pass
    if os.getppid() != parent:                               # the API process died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-engine-core")
    p.add_argument("--parent-pid", type=int, required=True, help="the API process (we die with it)")
    args = p.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):              # see the module docstring
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(level=envs.PDSERVE_LOG_LEVEL, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    start = m.read_start(sys.stdin.buffer)
    threading.Thread(target=_watch_lifeline, args=(sys.stdin.buffer,), name="pdserve-lifeline", daemon=True).start()
    code = serve(start)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                           # no interpreter teardown: every thread and socket is done with


if __name__ == "__main__":
    import pdserve.engine.cli  # noqa: F401 - drops a source checkout from sys.path (its kernels/ shadows a package)

    main()
