"""A real OTLP/HTTP trace endpoint for tests: ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest``.

    with OTLPCollector() as collector:          # listening on 127.0.0.1, a thread of its own
        ... processes started with --otlp-traces-endpoint collector.url send their spans here ...
        spans = collector.wait_for(lambda spans: ..., timeout_s=30)

Each span is decoded with the opentelemetry-proto package (what the SDK's OTLP/HTTP exporter sends, gzip or not)
into a ``Span``: ids as hex, its service (the resource's ``service.name``), times in ns and its attributes.
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                        ExportTraceServiceResponse)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str          # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(Span(resource.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(), s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes}))
    return out


class OTLPCollector:
    def __init__(self):
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode(body) if self.path == "/v1/traces" else None
                if spans is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                with collector._lock:
                    collector.spans += spans
                    collector.requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "OTLPCollector":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done, timeout_s: float = 30.0) -> list[Span]:
        """Poll (every 20 ms) until ``done(spans)`` is true; the spans then, or AssertionError at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"collector: condition not met within {timeout_s}s; got "
                                     f"{sorted({(s.service, s.name) for s in spans})}")
            time.sleep(0.02)
