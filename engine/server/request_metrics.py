"""What one engine request leaves behind: its histograms and counters, and (tracing on) its spans.

Called by ``generation.Generation`` for every engine request (one choice of one HTTP request):

    tracker = RequestTracker(metrics, arrival, max_tokens, trace, num_prompt_tokens)   # trace: RequestTrace, None
                                        # when tracing is off; num_prompt_tokens: the prompt's length (an abort
                                        # before any output still observes it in vllm:request_prompt_tokens)
    tracker.on_output(delta)            # each delta: TTFT at the first token (+ vllm:prompt_tokens), ITL after
                                        # (between the core's step_time of consecutive outputs, as vLLM)
    tracker.on_end(reason)              # exactly once (stop | length | abort | error): e2e, token counts, and the
                                        # engine core's RequestTimes: queue / prefill / decode / inference, the KV
                                        # load (lmcache:time_to_retrieve) and publish (lmcache:time_to_store)

Times: ``arrival`` and the TTFT / ITL / e2e clocks are this (API) process's ``time.monotonic()``; the engine core's
``RequestTimes`` (first output with a token, final output) read the same clock on the same host. vLLM's intervals:
queue = scheduled - queued, prefill = first token - scheduled, decode = last token - first token, inference =
last token - scheduled; TPOT = decode / the intervals inside it (a decode node's first token is the prefill node's:
one interval fewer). A request that never ran (aborted while waiting) observes no queue / prefill / decode.
"""

from __future__ import annotations

import time

from pdserve.engine.outputs import RequestTimes
from pdserve.engine.server.metrics import ServerMetrics


class RequestTracker:
    def __init__(self, metrics: ServerMetrics, arrival: float, max_tokens: int, trace=None, num_prompt_tokens: int = 0):
        self._m, self._arrival, self._max_tokens, self.trace = metrics, arrival, max_tokens, trace
        self._last: float | None = None
        self.num_prompt_tokens, self.num_generation_tokens = num_prompt_tokens, 0
        self.times: RequestTimes | None = None
        self._before_first: int | None = None   # tokens output before the first one sampled here (a decode node: 1)
        self.kv_accounting: dict | None = None
        self.ended = False

    def on_output(self, delta) -> None:
        if delta.times is not None:
            self.times = delta.times
            if self._before_first is None and delta.times.first_token:
                self._before_first = self.num_generation_tokens
        if delta.kv_accounting is not None:
            self.kv_accounting = delta.kv_accounting
        self.num_prompt_tokens = delta.num_prompt_tokens
        num_new = len(delta.new_token_ids)
        if not num_new:
            return
        now = time.monotonic()
        stamp = delta.step_time or now              # the core's clock (vLLM's ITL): not this loop's delays
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
            self._m.prompt_tokens.inc(delta.num_prompt_tokens)
        else:
            self._m.itl.observe(max(0.0, stamp - self._last))
        self._last = stamp
        self.num_generation_tokens += num_new
        self._m.generation_tokens.inc(num_new)

    def on_end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        now = time.monotonic()
        m = self._m
        m.finished(reason)
        m.e2e.observe(now - self._arrival)
        m.prompt_len.observe(self.num_prompt_tokens)
        m.generation_len.observe(self.num_generation_tokens)
        m.max_tokens.observe(self._max_tokens)
        if self.times is not None:
            self._observe_times(self.times, now)
        if self.trace is not None:
            self.trace.finish(self, reason, now)

    def _observe_times(self, t: RequestTimes, now: float) -> None:
        m, last = self._m, t.last_token or now
        if t.scheduled:
            m.queue.observe(max(0.0, t.scheduled - t.queued))
            m.inference.observe(max(0.0, last - t.scheduled))
            if t.first_token:
                m.prefill.observe(max(0.0, t.first_token - t.scheduled))
                decode = max(0.0, last - t.first_token)
                m.decode.observe(decode)
                intervals = self.num_generation_tokens - 1 - (self._before_first or 0)   # inside ``decode``
                if intervals > 0:
                    m.tpot.observe(decode / intervals)
        if t.kv_load_end:
            m.kv_load.observe(max(0.0, t.kv_load_end - t.kv_load_start))
            m.retrieve_requests.inc()
            m.kv_loaded_bytes.inc(t.kv_loaded_bytes)
        if t.kv_publish_end:
            m.kv_publish.observe(max(0.0, t.kv_publish_end - t.kv_publish_start))
            m.store_requests.inc()
            m.kv_published_bytes.inc(t.kv_published_bytes)
