"""The spans of one engine request on a node (tracing on: ``--otlp-traces-endpoint``), from the core's times.

Made by ``generation.Generation`` for each engine request when ``tracing.enabled()`` (None otherwise: nothing
here runs, nothing is imported); ``RequestTracker.on_end`` calls ``finish`` once. The spans are recorded after the
fact with the engine core's ``RequestTimes`` (as vLLM records its ``llm_request`` span when the request ends), under
the caller's W3C context (the proxy's ``traceparent``, ``tracing.extract``):

    llm_request (server)  arrival ───────────────────────────────────────────── end         gen_ai.* attributes
      ├ queue              queued ── scheduled                                               pdserve.kv.* figures
      ├ kv_load              load start ── load end   (decode role: inside the queue time)
      ├ prefill                           scheduled ── first token
      ├ decode                                         first token ── last token
      └ kv_publish                                     publish start ──── publish end (prefill role)

Attribute names: OpenTelemetry's gen_ai semantic conventions as vLLM sets them (``gen_ai.request.*``,
``gen_ai.usage.*``, ``gen_ai.latency.*``), and ``pdserve.kv.*`` for the KV transfer (bytes, GB/s, accounting).
"""

from __future__ import annotations

from pdserve.engine import tracing


class RequestTrace:
    def __init__(self, parent, request_id: str, model_name: str, role: str, arrival: float, params):
        self.parent, self.request_id, self.model_name, self.role = parent, request_id, model_name, role
        self.arrival, self.params = arrival, params

    def finish(self, tracker, reason: str, now: float) -> None:
        t = tracker.times
        root = tracing.start_span("llm_request", "server", self.parent, tracing.wall_ns(self.arrival),
                                  self._attributes(tracker, reason, now))
        if t is not None:
            last = t.last_token or now
            self._child(root, "queue", t.queued, t.scheduled)
            self._child(root, "kv_load", t.kv_load_start, t.kv_load_end, _kv(t.kv_loaded_bytes, t.kv_load_start,
                                                                             t.kv_load_end))
            self._child(root, "prefill", t.scheduled, t.first_token,
                        {"gen_ai.usage.prompt_tokens": tracker.num_prompt_tokens})
            self._child(root, "decode", t.first_token, last if t.first_token else 0.0,
                        {"gen_ai.usage.completion_tokens": tracker.num_generation_tokens})
            self._child(root, "kv_publish", t.kv_publish_start, t.kv_publish_end,
                        _kv(t.kv_published_bytes, t.kv_publish_start, t.kv_publish_end))
        tracing.end(root, tracing.wall_ns(now), error=None if reason != "error" else "request failed")

    def _child(self, root, name: str, start: float, end: float, attributes: dict | None = None) -> None:
        if start and end and end >= start:
            span = tracing.start_span(name, "internal", root, tracing.wall_ns(start), attributes)
            tracing.end(span, tracing.wall_ns(end))

    def _attributes(self, tracker, reason: str, now: float) -> dict:
        p, t = self.params, tracker.times
        out = {"gen_ai.system": "pdserve", "gen_ai.response.model": self.model_name,
               "gen_ai.request.id": self.request_id, "gen_ai.request.max_tokens": p.max_tokens,
               "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": getattr(p, "top_p", 1.0),
               "gen_ai.usage.prompt_tokens": tracker.num_prompt_tokens,
               "gen_ai.usage.completion_tokens": tracker.num_generation_tokens,
               "gen_ai.response.finish_reasons": [reason], "gen_ai.latency.e2e": now - self.arrival,
               "pdserve.role": self.role}
        if t is not None and t.scheduled:
            out["gen_ai.latency.time_in_queue"] = t.scheduled - t.queued
            if t.first_token:
                out["gen_ai.latency.time_in_model_prefill"] = t.first_token - t.scheduled
                out["gen_ai.latency.time_in_model_decode"] = (t.last_token or now) - t.first_token
        for name, value in (tracker.kv_accounting or {}).items():
            out[f"pdserve.kv.{name}"] = value
        return out


def _kv(num_bytes: int, start: float, end: float) -> dict:
    seconds = end - start
    return {"pdserve.kv.bytes": num_bytes, "pdserve.kv.gbps": num_bytes / seconds / 1e9 if seconds > 0 else 0.0}
