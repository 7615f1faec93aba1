"""The engine behind the HTTP node: one engine thread steps ``LLMEngine``; asyncio callers stream deltas.

Who calls what, in order:

    server (event loop)                     engine thread
    -------------------                     -------------
    generate(ids, params, id) ──"add"──>    drain inbox -> engine.add_request
      (= submit(...) now, then stream(id, queue): the HTTP handlers submit before their response starts)
                                            engine.step() -> deltas
    async for delta  <──call_soon_threadsafe── (one asyncio.Queue per request)
    abort(id) / client gone ──"abort"──>    engine.abort_request (frees its blocks)

Only the engine thread touches ``LLMEngine``; the inbox is the single hand-off point. A request's own
failure fails that request inside ``LLMEngine.step``; an exception that escapes a step is unrecoverable:
it fails every in-flight request with its message, marks the engine dead and calls ``on_fatal`` (the
node then exits non-zero, so that its supervisor restarts it).

With ``config.engine_core_process`` (``pdserve node``'s default; ``--no-engine-core-process`` turns it off) there is no engine thread:
``self.engine`` is an ``EngineCoreClient`` (``pdserve.engine.core``) with the same methods, which sends
adds and aborts to the engine-core process at once and delivers its outputs from a receiver thread;
a core that dies ends every stream the same way (``_die``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from contextlib import aclosing
from typing import AsyncIterator

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineDeadError, EngineStats, RequestOutput
from pdserve.kvstore.stats_cache import StatsCache

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.model_name = config.model_name
        self.role = config.kv_transfer.role
        self.block_size = config.cache.block_size
        kvt = config.kv_transfer                 # the Redis key prefix an embedded store writes under (the card's)
        self._redis_prefix = kvt.kv_redis_prefix if kvt.kv_store == "embedded" and kvt.kv_redis else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._fatal: str | None = None
        self.on_fatal = None                 # called once (from the engine thread) when the engine dies
        self._store_stats, self._thread = None, None
        if config.engine_core_process:
            from pdserve.engine.core.client import EngineCoreClient

            self.engine = EngineCoreClient(config, deliver=self._deliver, die=self._die)
        else:
            self.engine = LLMEngine(config)
            self._store_stats = StatsCache(self.engine.store) if self.engine.store is not None else None
            self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
            self._thread.start()
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len

    async def generate(self, prompt_token_ids: list[int], params, request_id: str,
                       kv_transfer_params: dict | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of one request; raises ``PromptTooLongError`` / ``TransferMismatchError`` up front, and the
        engine's ``add_request`` errors (a prompt token id not in the vocabulary: ValueError) as the first item."""
        out_q = self.submit(prompt_token_ids, params, request_id, kv_transfer_params, cache_salt)
        async with aclosing(self.stream(request_id, out_q)) as deltas:   # closed with us, not when collected:
            async for item in deltas:                                     # a late abort would hit a reused id
                yield item

    def submit(self, prompt_token_ids: list[int], params, request_id: str,
               kv_transfer_params: dict | None = None, cache_salt: str | None = None) -> asyncio.Queue:
        """Send the request to the engine now (no await: a burst's adds do not wait behind the event loop's
        other work) and return the queue its deltas arrive on; ``stream`` reads it. Raises as ``generate``."""
        self.engine.check_prompt(len(prompt_token_ids), params.max_tokens)
        self.engine.check_transfer(kv_transfer_params)
        if self._fatal:
            raise EngineDeadError(self._fatal)
        out_q: asyncio.Queue = asyncio.Queue()
        self._send(("add", request_id, list(prompt_token_ids), params, kv_transfer_params, cache_salt,
                    asyncio.get_running_loop(), out_q))
        return out_q

    async def stream(self, request_id: str, out_q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The deltas ``submit`` queued for ``request_id``; leaving before its final one aborts it."""
        finished = False
        try:
            while not finished:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def kv_card(self) -> dict:
        """What the proxy's kv_aware routing needs to know of this node (``/v1/models``' ``kv`` field): its block
        size, KV-event and replay endpoints, its store's key space (fingerprint, chunk size, layers), None
        without one, and the key prefix its embedded store writes to Redis under (None: none; never the URL)."""
        info = self.engine.store_info()
        store = None if info is None else {"fingerprint": info.fingerprint, "chunk_tokens": info.chunk_tokens,
                                           "num_layers": info.num_layers}
        return {"block_size": self.block_size, "events": self.engine.kv_events_endpoint or None,
                "replay": self.engine.kv_replay_endpoint or None, "store": store, "redis_prefix": self._redis_prefix}

    def stats(self) -> EngineStats:
        if self._thread is None:
            return self.engine.stats()           # the engine-core process's last report
        return collect_stats(self.engine, self._store_stats)

    @property
    def fatal(self) -> str | None:
        """Why the engine died (None while it is alive)."""
        return self._fatal

    def is_healthy(self) -> bool:
        """False once a step failed, or once a tp x pp worker rank died or stalled (even while idle)."""
        if self._thread is None:
            return self._fatal is None and self.engine.is_alive()
        return self._fatal is None and self._thread.is_alive() and getattr(self.engine.runner, "failure", None) is None

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._store_stats is not None:
            self._store_stats.close()
        self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        if self._thread is None:              # an engine-core process: the client sends at once, any thread
            return self._apply(command)
        self._inbox.put(command)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            rank_failure = getattr(self.engine.runner, "failure", None)
            if rank_failure is not None:      # a tp x pp rank died or stalled, even while idle
                return self._die(f"engine stopped: {rank_failure}")
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug or a broken model: fail loudly, never hang the clients
                logger.exception("engine step failed beyond recovery; failing %d requests", len(self._streams))
                return self._die(f"engine step failed: {type(exc).__name__}: {exc}")
            for out in outputs:
                self._deliver(out.request_id, out, final=out.finished)

    def _die(self, message: str) -> None:
        """Unrecoverable: fail every stream, then let the node stop (it exits non-zero)."""
        self._fail_all(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            self._add(*command[1:])
        else:
            self.engine.abort_request(command[1])
            self._streams.pop(command[1], None)

    def _add(self, request_id, prompt_ids, params, transfer, cache_salt, loop, out_q) -> None:
        self._streams[request_id] = (loop, out_q)
        try:
            self.engine.add_request(request_id, prompt_ids, params, transfer, cache_salt)
        except Exception as exc:
            self._deliver(request_id, exc, final=True)

    def _deliver(self, request_id: str, item, final: bool) -> None:
        target = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if target is not None:
            loop, out_q = target
            try:
                loop.call_soon_threadsafe(out_q.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                logger.debug("dropping output for %s: its event loop is closed", request_id)

    def _fail_all(self, message: str) -> None:
        self._fatal = message
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(message), final=True)


def collect_stats(engine: LLMEngine, store_stats: StatsCache | None) -> EngineStats:
    """The engine's figures for ``/metrics`` (the engine thread's, or the engine-core process's own)."""
    sched, bm = engine.scheduler, engine.block_manager
    queries, hits = bm.prefix_cache_stats
    return EngineStats(num_running=sched.num_running, num_waiting=sched.num_waiting, kv_usage=bm.usage,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, kv_totals=dict(engine.outputs.totals),
                       kv_store=store_stats.get() if store_stats else {},
                       kv_transfer=engine.connector.stats() if engine.connector else {},
                       num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
                       num_preemptions=sched.num_preemptions, iteration_tokens=list(engine.iterations.counts),
                       iteration_tokens_sum=engine.iterations.total)
