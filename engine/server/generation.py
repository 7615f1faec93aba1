"""Runs the engine requests behind one HTTP request and cleans up whatever way it ends.

Called by ``completions.py`` and ``chat.py``:

    gen = Generation(engine, metrics, calls, arrival, n, trace_parent)   # one EngineCall per choice (prompts x n);
                                                         # trace_parent: the caller's trace context (tracing on)
    gen.start()                                          # every call sent to the engine now (no await)
    async with aclosing(gen.outputs()) as it:            # streaming: (choice index, delta) as they come
        async for index, delta in it: ...
    choices = await gen.collect(request)                 # non-streaming: whole choices; aborts when
                                                         # the client disconnects while waiting

Each choice is an independent engine request (``n`` > 1 included), submitted by ``start`` (the engine
has it before the response begins: in a burst, the pump tasks would run only after the event loop has
taken in every other arriving request) and pumped by its own task into one queue. However the consumer
stops (finished, client gone, error, cancellation), ``outputs``' ``finally`` cancels the pumps and calls
``engine.abort`` for every unfinished request, shielded from cancellation, so a disconnected client never
leaves blocks allocated; ``close`` does the same for a response that never began to iterate ``outputs``.
A call the engine refused at ``submit`` (a 4xx such as kv_transfer_params it cannot serve, or 503) records no
metrics: like vLLM, a request that never entered the engine is not a finished request.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import anyio
from starlette.requests import Request

from pdserve.engine.outputs import EngineDeadError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server.errors import APIError
if TYPE_CHECKING:
    from pdserve.engine.server.request_trace import RequestTrace
from pdserve.engine.server.metrics import ServerMetrics
from pdserve.engine.server.request_metrics import RequestTracker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineCall:
    request_id: str          # the engine's id: "<http id>-<choice index>"
    index: int               # the choice index in the response
    prompt_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict | None = None   # P/D hand-off for this engine request
    cache_salt: str | None = None            # the body's ``cache_salt``: shares KV only with the same salt


@dataclass
class Choice:
    """One choice, accumulated from its deltas."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # prefill role: what the decode node needs
    kv_accounting: dict | None = None        # with a KV store: this node's figures
    prompt_logprobs: list | None = None      # PromptLogprob of prompt tokens 1.. (with the first token, if asked)

    def add(self, delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids += delta.new_token_ids
        self.text += delta.new_text
        self.logprobs += delta.logprobs or []
        self.num_prompt_tokens, self.num_cached_tokens = delta.num_prompt_tokens, delta.num_cached_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.kv_transfer_params = getattr(delta, "kv_transfer_params", None)
            self.kv_accounting = getattr(delta, "kv_accounting", None)


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


class Generation:
    def __init__(self, engine, metrics: ServerMetrics, calls: list[EngineCall], arrival: float, n: int = 1,
                 trace_parent=None):
        """``trace_parent``: None unless tracing is on (``tracing.extract`` of the HTTP request's headers, or an
        empty context for a request without one); then each engine request records its spans (request_trace)."""
        self._engine, self._calls, self._metrics, self._n = engine, calls, metrics, max(1, n)
        self._trackers = {c.request_id: RequestTracker(metrics, arrival, c.params.max_tokens,
                                                       _trace(engine, c, arrival, trace_parent), len(c.prompt_ids))
                          for c in calls}
        self._finished: set[str] = set()             # ended, or being aborted
        self._ended: set[str] = set()                # their metrics recorded (``_end``, once each)
        self._refused: set[str] = set()              # ``submit`` raised: the engine never had them, no metrics
        self._submitted: dict[str, asyncio.Queue | Exception] | None = None   # id -> its deltas, or why not

    def start(self) -> None:
        """Submit every call to the engine now; a call the engine refuses fails when its pump runs.
        ``outputs`` starts a generation nobody started (idempotent)."""
        if self._submitted is not None:
            return
        self._submitted = {}
        for call in self._calls:
            try:
                self._submitted[call.request_id] = self._engine.submit(
                    call.prompt_ids, call.params, call.request_id, call.kv_transfer_params, call.cache_salt)
            except Exception as exc:  # noqa: BLE001 - delivered by _pump, as generate() would have raised it
                self._submitted[call.request_id] = exc
                self._refused.add(call.request_id)

    async def close(self) -> None:
        """Abort what was submitted and is not finished (idempotent; ``outputs``' own clean-up does it too)."""
        with anyio.CancelScope(shield=True):
            await self._abort_unfinished()

    async def outputs(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, RequestOutput) in arrival order; raises APIError when a request fails."""
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(call, queue)) for call in self._calls]
        remaining = len(pumps)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup(pumps)

    async def collect(self, request: Request) -> list[Choice]:
        """All choices, complete; raises ClientDisconnected (after aborting) if the client leaves."""
        work = asyncio.create_task(self._collect())
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientDisconnected()
            return work.result()
        finally:
            for task in (work, watch):
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work, watch, return_exceptions=True)
                await self._abort_unfinished()     # ``work`` cancelled before it ran: nothing aborted yet

    async def _collect(self) -> list[Choice]:
        choices = {c.index: Choice(c.index) for c in self._calls}
        async with aclosing(self.outputs()) as stream:
            async for index, delta in stream:
                choices[index].add(delta)
        return [choices[i] for i in sorted(choices)]

    async def _pump(self, call: EngineCall, queue: asyncio.Queue) -> None:
        tracker = self._trackers[call.request_id]
        try:
            async with aclosing(self._deltas(call)) as stream:
                async for delta in stream:
                    self._record(call.request_id, tracker, delta)
                    queue.put_nowait((call.index, delta))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._end(call.request_id, "error")
            queue.put_nowait(_as_api_error(call.request_id, exc))
        queue.put_nowait(None)

    def _deltas(self, call: EngineCall) -> AsyncIterator:
        submitted = self._submitted.pop(call.request_id)
        if isinstance(submitted, Exception):
            return _raises(submitted)
        return self._engine.stream(call.request_id, submitted)

    def _record(self, request_id: str, tracker: RequestTracker, delta) -> None:
        tracker.on_output(delta)
        if delta.error:
            raise RuntimeError(delta.error)
        if delta.finished:
            self._end(request_id, delta.finish_reason or "stop")

    def _end(self, request_id: str, reason: str) -> None:
        """An engine request ended (once each); when the last one has, the per-prompt figures (vLLM's n and
        max generation tokens of a prompt's n choices)."""
        self._finished.add(request_id)
        if request_id in self._ended:
            return
        self._ended.add(request_id)
        if request_id not in self._refused:          # a 4xx / 503 at submit: not a request (vLLM counts none)
            self._trackers[request_id].on_end(reason)
        if len(self._ended) < len(self._calls):
            return
        tokens: dict[int, int] = {}
        for call in self._calls:
            if call.request_id in self._refused:
                continue
            prompt = call.index // self._n
            tokens[prompt] = max(tokens.get(prompt, 0), self._trackers[call.request_id].num_generation_tokens)
        for most in tokens.values():
            self._metrics.n.observe(self._n)
            self._metrics.max_generation.observe(most)

    async def _cleanup(self, pumps: list[asyncio.Task]) -> None:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await self._abort_unfinished()

    async def _abort_unfinished(self) -> None:
        for call in self._calls:
            if call.request_id not in self._finished:
                self._finished.add(call.request_id)
                logger.info("aborting %s: its client stopped reading", call.request_id)
                await self._engine.abort(call.request_id)
                self._end(call.request_id, "abort")


def _trace(engine, call: EngineCall, arrival: float, parent) -> RequestTrace | None:
    if parent is None:
        return None
    from pdserve.engine.server.request_trace import RequestTrace
    return RequestTrace(parent, call.request_id, engine.model_name, getattr(engine, "role", "both"), arrival,
                        call.params)


async def _raises(exc: Exception) -> AsyncIterator:
    raise exc
    yield                                      # an async generator that raises on its first step


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _as_api_error(request_id: str, exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):     # the node is stopping (exit 1): another node can serve it
        return APIError(503, f"request {request_id} failed: {exc}")
    if isinstance(exc, ValueError):          # the engine's own checks (prompt length, ...)
        return APIError(400, str(exc))
    logger.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
    return APIError(500, f"request {request_id} failed: {type(exc).__name__}: {exc}")
