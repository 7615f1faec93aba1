"""Continuous batching with chunked prefill, decode-first, and preemption by recompute.

Called by ``LLMEngine.step`` in this order, once per step::

    out = scheduler.schedule()                       # who runs, how many tokens each
    sampled = runner.execute(out)                    # {request_id: token} for requests whose
                                                     #   scheduled chunk reached their last token
    finished = scheduler.update_from_output(out, sampled)

``update_from_output`` must be called for every ``schedule()`` result, an empty one included
(it also returns the requests ``schedule`` had to reject). ``add_request``, ``abort_request``
and ``finish_request`` (stop strings, found by the detokenizer) may come between steps.

One step spends at most ``max_num_batched_tokens`` tokens: first on running requests (those
with 1 token left, the decodes, before those still prefilling, which get their next chunk),
then on waiting requests in FCFS order (preempted ones sit at the front). A request that
needs a block when none is free preempts the most recently arrived running request (maybe
itself): its blocks are freed and it recomputes prompt + output later. Work per step is
O(running + admitted), never O(blocks).

With a KV connector (``pdserve.engine.kv.kv_connector``), a request admitted for the first time
asks it how many tokens beyond the local prefix-cache hit the store can supply. If any, the
request takes blocks for them and waits in WAITING_FOR_KV (in ``loading``, counted against
``max_num_seqs``, spending no token budget) while the loader fills those blocks; when the load
reports back, the request joins ``running`` with those tokens computed (a failed load reports 0:
the tokens are recomputed). A request aborted while loading keeps its blocks until the loader
is done with them. The connector's answer comes from a store lookup that runs off the engine thread: while it
has not answered (``num_loadable_tokens`` -> None, vLLM's ``get_num_new_matched_tokens``) the request keeps its
place in the waiting queue, takes no blocks and no budget, the requests behind it are scheduled as if it were
not there, and it is asked again next step.

With a layerwise connector (``--kv-load-layerwise``) the request does not wait: it is scheduled at once with the
loaded range counted as computed, the load lands layer by layer during that step, and a load that failed makes
``update_from_output`` rewind it (``rewound``: its computed tokens go back to the load's start, it keeps its
blocks, nothing of that step counts) to recompute from its local prefix.

With structured outputs (``grammars``: the engine's ``StructuredOutputManager``), a request with a constraint
waits in WAITING_FOR_GRAMMAR (in ``compiling``: no blocks, no budget, not counted against ``max_num_seqs``)
until its grammar is compiled, then joins the waiting queue at the back; the requests behind it go on. A
compile that fails finishes it aborted (in ``rejected``, its reason in ``stop_reason``). Each sampled token
advances its matcher (``grammars.accept``); a completed constraint finishes the request with "stop".
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.sched.block_manager import BlockManager
from pdserve.engine.sched.request import Request, RequestStatus, check_stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ScheduledRequest:
    request: Request
    num_new_tokens: int        # compute tokens [first_token_index, first_token_index + num_new_tokens)
    first_token_index: int     # == request.num_computed_tokens when scheduled
    samples: bool = field(init=False)   # the chunk ends at the request's last token: sample one

    def __post_init__(self) -> None:
        end = self.first_token_index + self.num_new_tokens
        object.__setattr__(self, "samples", end == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)   # freed this step; will recompute
    rejected: list[Request] = field(default_factory=list)    # can never fit: FINISHED_*, freed
    num_batched_tokens: int = 0
    grammar_bitmask: object | None = None   # GrammarBitmask of the step's structured samples (set by LLMEngine)
    load_hooks: object | None = None        # LayerHooks of the step's layerwise loads (set by LLMEngine)
    kv_publish_hooks: object | None = None  # LayerHooks publishing the step's chunks layerwise (set by LLMEngine)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, connector=None, grammars=None):
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # sorted by arrival (the last one is preempted first)
        self.connector = connector
        self.loading: dict[str, Request] = {}     # WAITING_FOR_KV, and aborted ones still loading
        self.grammars = grammars                  # StructuredOutputManager (engine/structured), or None
        self.compiling: dict[str, Request] = {}   # WAITING_FOR_GRAMMAR
        self._requests: dict[str, Request] = {}   # every unfinished request
        self._order: dict[str, tuple[float, int]] = {}
        self._next_seq = 0
        self.num_preemptions = 0                  # cumulative (vllm:num_preemptions)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; "
                             f"--max-model-len is {self.max_model_len}")
        structured = request.sampling_params.structured is not None
        if structured:
            if self.grammars is None:
                raise ValueError("this engine has no structured-output support (no grammar manager)")
            self.grammars.add(request)
        self._requests[request.request_id] = request
        self._order[request.request_id] = (request.arrival_time, self._next_seq)
        self._next_seq += 1
        if structured:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.compiling[request.request_id] = request
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort at any point: frees the request's blocks. None if it is unknown or finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End an unfinished request with ``status`` (a FINISHED_* one) and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING_FOR_KV:
            request.status = status              # blocks stay until the loader reports back
            del self._requests[request_id]
            del self._order[request_id]
            self._release_grammar(request)
            return request
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self.compiling[request_id]
        else:
            self.waiting.remove(request)
        self._retire(request, status)
        return request

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """vLLM's ``num_requests_waiting``: queued for admission, loading remote KV (WAITING_FOR_KV) or compiling
        its grammar (WAITING_FOR_GRAMMAR) -- vLLM keeps both of the latter in its waiting queue."""
        loading = sum(1 for r in self.loading.values() if not r.status.is_finished)
        return len(self.waiting) + len(self.compiling) + loading

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.compiling:
            self._finish_compiles(out)
        if self.connector is not None:
            self._finish_loads()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        chosen: dict[str, ScheduledRequest] = {}
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self.running[-1]
                budget += self._preempt(victim, chosen, out)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                chosen[req.request_id] = ScheduledRequest(req, num_new, req.num_computed_tokens)
                budget -= num_new
        out.scheduled.extend(chosen.values())
        return budget

    def _preempt(self, victim: Request, chosen: dict[str, ScheduledRequest], out: SchedulerOutput) -> int:
        """Preempt by recompute; returns the budget given back if it was already chosen."""
        self.running.pop()
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        logger.debug("preempt %s (%d tokens): no free KV block", victim.request_id, victim.num_tokens)
        undone = chosen.pop(victim.request_id, None)
        return undone.num_new_tokens if undone is not None else 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []     # their store lookup has not answered: they keep their place in the queue
        try:
            self._admit_waiting(out, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, skipped: list[Request]) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting[0]
            if bm.num_blocks_for(req.num_tokens) > bm.num_blocks:
                self.waiting.popleft()
                self._reject(req, out)
                continue
            blocks, num_hit = bm.get_computed_blocks(req)
            num_load = self._loadable(req, num_hit)
            if num_load is None:                         # asked again next step; the requests behind it go on
                skipped.append(self.waiting.popleft())
                continue
            if num_load and not getattr(self.connector, "load_layerwise", False):
                if not bm.allocate_slots(req, num_load, blocks):
                    break
                self._start_load(req, num_hit, num_load)
                continue
            num_new = min(req.num_tokens - num_hit - num_load, budget)    # a load never covers the last token
            if not bm.allocate_slots(req, num_load + num_new, blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit + num_load
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
            if num_load:                                 # layerwise: it lands during this step
                req.num_loaded_tokens = num_load
                self.connector.start_load(req, num_hit, num_load)
            req.status = RequestStatus.RUNNING
            req.scheduled_time = req.scheduled_time or time.monotonic()
            bisect.insort(self.running, req, key=lambda r: self._order[r.request_id])
            out.scheduled.append(ScheduledRequest(req, num_new, num_hit + num_load))
            budget -= num_new

    # ---- structured outputs -------------------------------------------------------------

    def _finish_compiles(self, out: SchedulerOutput) -> None:
        """Requests whose grammar is ready join the waiting queue; a failed compile finishes its request."""
        for request_id, req in list(self.compiling.items()):
            try:
                if not self.grammars.poll(req):
                    continue
            except Exception as exc:  # noqa: BLE001 - a bad constraint fails its request only
                del self.compiling[request_id]
                req.stop_reason = str(exc)
                self._retire(req, RequestStatus.FINISHED_ABORTED)
                out.rejected.append(req)
                continue
            del self.compiling[request_id]
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    def _release_grammar(self, req: Request) -> None:
        if self.grammars is not None and req.sampling_params.structured is not None:
            self.grammars.release(req.request_id)

    # ---- remote KV ------------------------------------------------------------------------

    def _loadable(self, req: Request, num_hit: int) -> int | None:
        """Tokens the connector will load beyond ``num_hit``; None: its store lookup is still running."""
        if self.connector is None or req.num_preemptions:
            return 0
        return self.connector.num_loadable_tokens(req, num_hit)

    def _start_load(self, req: Request, num_hit: int, num_load: int) -> None:
        self.waiting.popleft()
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[req.request_id] = req
        self.connector.start_load(req, num_hit, num_load)

    def _finish_loads(self) -> None:
        for request_id, loaded in self.connector.finished_loads().items():
            req = self.loading.pop(request_id, None)
            if req is None:
                continue
            if req.status.is_finished:           # aborted while loading: now the blocks can go
                self.block_manager.free(req)
                continue
            req.num_computed_tokens += loaded
            req.num_loaded_tokens = loaded
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            req.scheduled_time = req.scheduled_time or time.monotonic()
            bisect.insort(self.running, req, key=lambda r: self._order[r.request_id])

    def _reject(self, req: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        need = bm.num_blocks_for(req.num_tokens)
        req.stop_reason = (f"request needs {need} KV blocks for {req.num_tokens} tokens "
                           f"({req.num_prompt_tokens} prompt + {req.num_output_tokens} output) but the KV "
                           f"cache has {bm.num_blocks} blocks of {bm.block_size} tokens; shorten the "
                           f"request or give the KV cache more memory")
        # A prompt that fits but grew past the cache while generating ends like max_tokens.
        prompt_fits = bm.num_blocks_for(req.num_prompt_tokens) <= bm.num_blocks
        status = RequestStatus.FINISHED_LENGTH if prompt_fits else RequestStatus.FINISHED_ABORTED
        logger.warning("request %s: %s", req.request_id, req.stop_reason)
        self._retire(req, status)
        out.rejected.append(req)

    # ---- results -------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           rewound: dict[str, int] | None = None) -> list[Request]:
        """Advance every scheduled request, append sampled tokens, check stops.

        ``rewound``: {request id: token} of requests whose step must not count (a layerwise load under it
        failed): they go back to that many computed tokens instead (``_rewind``).
        Returns the requests that finished in this step (rejected ones included); they are
        already freed. Requests finished or aborted since ``schedule()`` are skipped.
        """
        finished, retired = list(output.rejected), False
        for item in output.scheduled:
            req = item.request
            if req.status != RequestStatus.RUNNING:
                continue
            if rewound and req.request_id in rewound:
                self._rewind(req, rewound[req.request_id])
                continue
            try:
                status = self._advance(req, item, sampled)
            except Exception as exc:  # noqa: BLE001 - fails this request only (logged by the engine)
                req.stop_reason = f"output update failed: {type(exc).__name__}: {exc}"
                status = RequestStatus.FINISHED_ABORTED
                output.rejected.append(req)
            if status is not None:
                self._retire(req, status)
                finished.append(req)
                retired = True
        if retired:
            self.running = [r for r in self.running if not r.status.is_finished]
        return finished

    def _advance(self, req: Request, item: ScheduledRequest, sampled: dict[str, int]) -> RequestStatus | None:
        """Count the computed tokens, append the sampled one; the finish status if it stops."""
        req.num_computed_tokens += item.num_new_tokens
        self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
        if not item.samples:
            return None
        if req.request_id not in sampled:
            raise KeyError(f"the runner returned no token for request {req.request_id!r}, whose "
                           f"chunk reached its last token ({req.num_tokens})")
        token = sampled[req.request_id]
        req.append_output_token(token)
        complete = req.sampling_params.structured is not None and self.grammars.accept(req, token)
        status = check_stop(req, self.max_model_len)
        return RequestStatus.FINISHED_STOPPED if status is None and complete else status

    def _rewind(self, req: Request, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` computed tokens (they are valid in its blocks); it keeps every block
        and the next schedule recomputes the rest, like a load that reported fewer tokens. Its blocks past
        ``num_tokens`` were never registered in the prefix cache (that happens after a step that counted)."""
        if not 0 <= num_tokens <= req.num_computed_tokens:
            raise ValueError(f"cannot rewind {req.request_id!r} to token {num_tokens}: it has "
                             f"{req.num_computed_tokens} computed")
        req.num_computed_tokens = num_tokens
        req.num_loaded_tokens = 0
        logger.debug("rewind %s to %d computed tokens", req.request_id, num_tokens)

    def _retire(self, req: Request, status: RequestStatus) -> None:
        self.block_manager.free(req)
        self._release_grammar(req)
        req.status = status
        del self._requests[req.request_id]
        del self._order[req.request_id]

    # ---- checks --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Queues agree with statuses and the block manager is consistent. For tests / debug."""
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        loading_ids = {rid for rid, r in self.loading.items() if not r.status.is_finished}
        compiling_ids = set(self.compiling)
        if running_ids & waiting_ids or running_ids | waiting_ids | loading_ids | compiling_ids != set(self._requests):
            raise RuntimeError(f"queues disagree: running {sorted(running_ids)} waiting "
                               f"{sorted(waiting_ids)} known {sorted(self._requests)}")
        for r in self.running:
            if r.status != RequestStatus.RUNNING or r.num_computed_tokens >= r.num_tokens:
                raise RuntimeError(f"running request {r.request_id!r} is {r.status.name} with "
                                   f"{r.num_computed_tokens}/{r.num_tokens} tokens computed")
        for r in self.waiting:
            if r.block_ids or r.num_computed_tokens or r.status not in (RequestStatus.WAITING,
                                                                         RequestStatus.PREEMPTED):
                raise RuntimeError(f"waiting request {r.request_id!r} is {r.status.name} with "
                                   f"{len(r.block_ids)} blocks, {r.num_computed_tokens} tokens computed")
        if len(self.running) > self.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} running > --max-num-seqs {self.max_num_seqs}")
        self.block_manager.check_integrity()
