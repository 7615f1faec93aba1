"""Scripted stand-ins for a node, and any ASGI app served from a thread of the test process (no tests here).

    node = FakeNode()                        # /health 200, /v1/models (max_model_len), POSTs scripted
    node.script("/v1/completions", Reply(status=429, headers={"Retry-After": "7"}))   # next POST there
    held = node.script("/v1/completions", Reply(hold=True))                           # ... held until
    held.gate.set()                                                                    # the test says so
    mid = node.script("/v1/completions", Reply(events=stream_of([" a", " b"]), hold_after=1, die=True))
    # a stream: its first event, then held; released, the connection is cut as a killed process's would be
    mid.gone.wait()                          # set if the caller closed its connection while the reply was held
    node.health_status = None                # /health answers nothing (a stopped process); 503: it answers 503
    node.calls, node.health_hits            # what the proxy sent, and how often it probed
    node.stop()

A POST with no script left gets ``Reply()``: a one-token completion (JSON) or stream (SSE), in the
endpoint's shape. Nothing here waits on time: a held reply waits on its gate or on the caller's hang-up.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.server.listen import bound_socket
from polling import POLL_INTERVAL_S, wait_until

MODEL = "llama"


@dataclass
class Reply:
    status: int = 200
    body: dict | None = None              # JSON body; None: a default completion (200) or error body
    events: list[dict] | None = None      # SSE payloads for a 200 stream; None: one token + finish
    headers: dict[str, str] = field(default_factory=dict)
    hold: bool = False                    # wait for the test to set ``gate`` before answering at all
    hold_after: int | None = None         # a stream: send this many events, then wait for ``gate``
    die: bool = False                     # a stream: once released, cut the connection mid-body
    gate: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)   # the caller hung up while held


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 from a daemon thread; ``stop()`` ends it."""

    def __init__(self, app, port: int | None = None):
        # no port given: bind one now and serve on that socket (a port picked free could be taken before uvicorn binds)
        sockets = None if port else [bound_socket("127.0.0.1", 0)]
        self.port = port or sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": sockets}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), 30, f"{self.url} started")
        if not self._server.started:
            raise RuntimeError(f"server on {self.url} did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def cut(self, client: tuple[str, int]) -> None:
        """Abort the TCP connection from ``client`` (host, port) without ending its response: what the
        kernel does to the sockets of a SIGKILLed server."""
        for connection in list(self._server.server_state.connections):
            if connection.client == client:
                connection.transport.abort()


class FakeNode:
    def __init__(self, max_model_len: int = 128):
        self.calls: list[tuple[str, dict]] = []
        self.health_hits = 0
        self.health_status: int | None = 200  # None: /health holds its answer until this changes or the caller leaves
        self.max_model_len = max_model_len
        self._scripts: dict[str, deque[Reply]] = defaultdict(deque)
        self._held: list[Reply] = []
        self._server = ServerThread(self._app())
        self.url = self._server.url

    def script(self, path: str, reply: Reply) -> Reply:
        self._scripts[path].append(reply)
        self._held.append(reply)
        return reply

    def posts(self, path: str | None = None) -> list[dict]:
        return [body for p, body in self.calls if path is None or p == path]

    def stop(self) -> None:
        for reply in self._held:            # nothing stays held past the test
            reply.gate.set()
        self._server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health(request: Request):
            self.health_hits += 1
            if self.health_status is None and not await self._unfrozen(request):
                return Response(status_code=499)
            return JSONResponse({"status": "ok"}, status_code=self.health_status)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(request: Request):
            body = await request.json()
            self.calls.append((request.url.path, body))
            scripts = self._scripts[request.url.path]
            reply = scripts.popleft() if scripts else Reply()
            if reply.hold and not await _released(reply, request):
                return Response(status_code=499)            # nobody is listening any more
            return _response(reply, request.url.path, body, self._stream(reply, request))

        return app

    async def _unfrozen(self, request: Request) -> bool:
        """Wait until ``health_status`` is set again (-> True) or the caller hangs up (-> False)."""
        hang_up = asyncio.ensure_future(_disconnected(request))
        try:
            while self.health_status is None:
                if hang_up.done():
                    return False
                await asyncio.sleep(POLL_INTERVAL_S)
            return True
        finally:
            hang_up.cancel()

    def _stream(self, reply: Reply, request: Request):
        """The SSE frames of a streamed ``reply``, held after ``hold_after`` of them (then cut if ``die``)."""
        async def frames(all_frames: list[str]):
            held = len(all_frames) if reply.hold_after is None else reply.hold_after
            for frame in all_frames[:held]:
                yield frame
            if reply.hold_after is None or not await _released(reply, request):
                return
            if reply.die:
                self._server.cut(tuple(request.client))
                await _disconnected(request)          # the response ends as the caller's did
                return
            for frame in all_frames[held:]:
                yield frame

        return frames


async def _released(reply: Reply, request: Request) -> bool:
    """Wait until the test sets ``reply.gate`` (-> True) or the caller closes its connection (-> False,
    and ``reply.gone`` is set)."""
    hang_up = asyncio.ensure_future(_disconnected(request))
    try:
        while not reply.gate.is_set():
            if hang_up.done():
                reply.gone.set()
                return False
            await asyncio.sleep(POLL_INTERVAL_S)
        return True
    except asyncio.CancelledError:           # the server cancelled the response: the caller is gone
        reply.gone.set()
        raise
    finally:
        hang_up.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _response(reply: Reply, path: str, body: dict, stream) -> Response:
    chat = path.endswith("/chat/completions")
    if reply.status != 200:
        error = reply.body or {"error": {"message": f"scripted {reply.status}", "type": "server_error",
                                         "param": None, "code": None}}
        return JSONResponse(error, status_code=reply.status, headers=reply.headers)
    if not body.get("stream"):
        return JSONResponse(reply.body or _completion(chat), headers=reply.headers)
    events = reply.events if reply.events is not None else _chunks(chat)
    frames = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return StreamingResponse(stream(frames), media_type="text/event-stream", headers=reply.headers)


def _completion(chat: bool) -> dict:
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": "Hi"}} if chat else {"text": "Hi"})
    return {"id": "fake-1", "object": "chat.completion" if chat else "text_completion", "created": 0, "model": MODEL,
            "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": None}


def _chunks(chat: bool, text: str = "Hi") -> list[dict]:
    """A stream in the node's shape: (chat: the role chunk,) one token, its finish."""
    base = {"id": "fake-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
            "model": MODEL}
    if chat:
        return [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]},
                {**base, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": "length"}]}]
    return [{**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]}]


def role_chunk() -> dict:
    """A chat stream's first chunk: the role, no token."""
    return _chunks(True)[0]


def error_event(kind: str = "server_error", message: str = "engine failed") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def tokens(text: str, chat: bool) -> list[dict]:
    return _chunks(chat, text)


def stream_of(pieces: list[str]) -> list[dict]:
    """A completions stream of one token per piece; the last one finishes (``length``)."""
    base = {"id": "fake-1", "object": "text_completion", "created": 0, "model": MODEL}
    return [{**base, "choices": [{"index": 0, "text": piece, "logprobs": None,
                                  "finish_reason": "length" if i == len(pieces) - 1 else None}]}
            for i, piece in enumerate(pieces)]
