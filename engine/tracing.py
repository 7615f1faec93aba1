"""OpenTelemetry traces (``--otlp-traces-endpoint``, vLLM's flag): off by default, and free when off.

Who calls what:

    pdserve node / proxy start-up    tracing.setup("pdserve-node", endpoint)    once; without an endpoint nothing
                                                                                 happens and OpenTelemetry is never
                                                                                 imported (``pip install pdserve[otel]``)
    proxy, per request               span = tracing.start_span("POST /v1/...", kind="server")
                                     with tracing.use(span): ...                  the node calls it makes carry
                                     tracing.inject() -> [b"traceparent: ..."]    W3C ``traceparent`` of the span in use
    node, per request                parent = tracing.extract(request.headers)    the proxy's context, or None
                                     (engine/server/request_trace.py records its spans from the core's times)
    shutdown                         tracing.shutdown()                           flushes the batch exporter, for at
                                                                                 most SHUTDOWN_TIMEOUT_S (a collector
                                                                                 down or slow never stalls a stop)

Every function checks ``enabled()`` first (one global read) and does nothing when tracing is off, so the
request path pays one ``if``. Spans go to an OTLP/HTTP (protobuf) endpoint through the SDK's batch processor
(``OTEL_BSP_*`` environment variables tune it); an endpoint without a path gets ``/v1/traces``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)
_state: dict = {}                     # "tracer", "provider", "otel" (the API modules): set by setup()
_NOTHING = contextlib.nullcontext()
MAX_TRACE_HEADER = 512               # the SDK's limit of traceparent (and W3C's minimum for tracestate): longer ignored
SHUTDOWN_TIMEOUT_S = 2.0              # the SDK's own shutdown waits up to 30 s on an unreachable collector (retries)


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint was given but the OpenTelemetry packages are not installed."""


def enabled() -> bool:
    return bool(_state)


def setup(service_name: str, endpoint: str | None) -> bool:
    """Export this process's spans to ``endpoint`` (OTLP/HTTP); None or "": tracing stays off. -> on?"""
    if not endpoint:
        return False
    url = traces_url(endpoint)
    try:
        from opentelemetry import context, propagate, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(f"--otlp-traces-endpoint {endpoint} needs OpenTelemetry: pip install "
                                 f"'pdserve[otel]' ({exc})") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _state.update(provider=provider, tracer=provider.get_tracer("pdserve"),
                  otel={"context": context, "propagate": propagate, "trace": trace})
    atexit.register(shutdown)            # ours, bounded (the SDK's exit hook would wait up to 30 s)
    logger.info("tracing on: %s spans to %s", service_name, url)
    return True


def setup_or_exit(service_name: str, endpoint: str | None, command: str) -> None:
    """``setup`` for a CLI: a bad URL or missing OpenTelemetry packages stop the start with the reason."""
    try:
        setup(service_name, endpoint)
    except (ValueError, TracingUnavailable) as exc:
        raise SystemExit(f"{command}: {exc}") from None


def traces_url(endpoint: str) -> str:
    """``http://host:4318`` -> ``http://host:4318/v1/traces``; a URL with a path is used as given."""
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r} is not an http(s):// URL (OTLP/HTTP)")
    return endpoint if url.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def shutdown(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Flush what is queued and stop exporting (idempotent), within ``timeout_s``: the SDK's batch processor
    waits up to 30 s for an export that retries against a collector that is down or does not answer, so it runs
    on a daemon thread and what it has not sent by then is dropped (logged), never the process's stop delayed."""
    provider = _state.pop("provider", None)
    _state.clear()
    if provider is None:
        return
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("tracing: spans not exported within %.1f s of shutdown (collector down or slow?): dropped",
                       timeout_s)


def extract(headers) -> object | None:
    """The W3C trace context in ``headers`` (a mapping with ``get``): an empty context without a ``traceparent``
    or with one longer than MAX_TRACE_HEADER (spans under it start a trace), None when tracing is off. A malformed
    traceparent is ignored by the SDK (a new trace); a tracestate over the limit is dropped."""
    if not _state:
        return None
    parent = headers.get("traceparent")
    if parent is None or len(parent) > MAX_TRACE_HEADER:     # W3C: 55 characters; the SDK logs a warning for each
        return _state["otel"]["context"].Context()           # longer one: a client's log flood, dropped unlogged
    state = headers.get("tracestate") or ""
    return _state["otel"]["propagate"].extract({"traceparent": parent,
                                                "tracestate": state if len(state) <= MAX_TRACE_HEADER else ""})


def inject() -> list[bytes]:
    """Header lines carrying the span in use (``use``), for a node call; [] when tracing is off."""
    if not _state:
        return []
    carrier: dict[str, str] = {}
    _state["otel"]["propagate"].inject(carrier)
    return [f"{name}: {value}".encode("latin-1") for name, value in carrier.items()]


def start_span(name: str, kind: str = "internal", parent=None, start_ns: int | None = None,
               attributes: dict | None = None):
    """A started span (None when tracing is off); ``parent``: a context from ``extract``, or a span; None: the
    span in use. ``start_ns``: wall-clock ns (``wall_ns``), default now. End it with ``end``."""
    if not _state:
        return None
    trace = _state["otel"]["trace"]
    if parent is not None and not isinstance(parent, dict) and hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)
    return _state["tracer"].start_span(name, context=parent, kind=getattr(trace.SpanKind, kind.upper()),
                                       start_time=start_ns, attributes=attributes)


def end(span, end_ns: int | None = None, attributes: dict | None = None, error: str | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        span.set_status(_state["otel"]["trace"].Status(_state["otel"]["trace"].StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def use(span):
    """Make ``span`` the one in use (``inject``, child spans) inside the block; nothing when it is None."""
    return _NOTHING if span is None else _use(span)


@contextlib.contextmanager
def _use(span):
    otel = _state["otel"]
    token = otel["context"].attach(otel["trace"].set_span_in_context(span))
    try:
        yield
    finally:
        otel["context"].detach(token)


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading (this host's, any process) as wall-clock ns, for span times."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
