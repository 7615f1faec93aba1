"""The streaming client, the runner and the result JSON against a scripted OpenAI-style SSE server.

The server (FastAPI under uvicorn on a free loopback port, in a thread) answers every request with
``max_tokens`` tokens bundled ``BUNDLE`` per chunk, then a usage chunk and ``[DONE]``; it counts
the requests open at once so that --max-concurrency can be checked from the server's side. The
prompt ``"crlf"`` gets the same events with ``\r\n`` line endings, SSE comments and ``event:`` lines
between them, each event's bytes split over two writes. With
``pair_up = N`` (N requests to come) each stream first waits until another is open or none is left to
come, so that two concurrent requests overlap at the server whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.client import RequestSpec, send
from pdserve.bench.datasets import DatasetConfig
from pdserve.bench.runner import TrafficConfig, make_client, run_requests, run_warmups
from pdserve.bench.serve import BenchConfig, run_bench_async
from pdserve.proxy.cluster import free_port
from polling import wait_until

BUNDLE = 3
DATA = Path(__file__).parent / "data"


class ScriptedServer:
    def __init__(self):
        self.open = self.peak = self.done = 0
        self.prompts: list[str] = []          # every completions prompt, in arrival order
        self.chats: list[list[dict]] = []     # every chat request's messages, in arrival order
        self.pair_up = 0                       # requests still to come that are held in pairs (0: none)
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.completions)
        self.app.get("/v1/models")(lambda: {"data": [{"id": "scripted", "root": "scripted"}]})

    async def completions(self, request: Request):
        body = await request.json()
        if isinstance(body.get("prompt"), str):
            self.prompts.append(body["prompt"])
        if isinstance(body.get("messages"), list):
            self.chats.append(body["messages"])
        if body.get("prompt") == "fail":
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        n = body.get("max_tokens") or body.get("max_completion_tokens")
        chat = "messages" in body
        events = self._events(n, chat, body.get("prompt") == "break")
        if body.get("prompt") == "crlf":
            events = _crlf(events)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, n: int, chat: bool, broken: bool):
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while self.pair_up and self.open < 2 and self.done + self.open < self.pair_up:
                await asyncio.sleep(0.005)    # a condition: another stream opens (or none will)
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for first in range(0, n, BUNDLE):
                await asyncio.sleep(0.01)
                text = "".join(f"t{i} " for i in range(first, min(n, first + BUNDLE)))
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield _sse({"choices": [choice], "usage": None})
                if broken:
                    yield _sse({"error": {"message": "decode node failed mid-stream"}})
                    break
            yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            yield b"data: [DONE]\n\n"
        finally:
            self.open -= 1
            self.done += 1


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _crlf(events):
    """The same events as another server may frame them: CRLF, comments, event names, split writes."""
    yield b": ping\r\n\r\n"
    async for event in events:
        event = b"event: message\r\n" + event.replace(b"\n", b"\r\n") + b":keep-alive\r\n\r\n"
        yield event[:len(event) // 2]
        yield event[len(event) // 2:]


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, 30, "scripted server started")
    server.url = f"http://127.0.0.1:{port}"
    yield server
    uv.should_exit = True
    thread.join(timeout=10)


def _send(spec: RequestSpec):
    async def go():
        async with make_client(None) as http:
            return await send(http, spec)
    return asyncio.run(go())


def test_bundled_chunks_completions(scripted):
    out = _send(RequestSpec(scripted.url + "/v1/completions", "openai", "scripted", "hi", 2, 10))
    assert out.success, out.error
    assert out.output_tokens == 10 and out.prompt_len == 7          # both from the usage chunk
    assert len(out.itl) == 3                                          # 4 chunks (3+3+3+1 tokens) -> 3 gaps
    assert out.generated_text == "".join(f"t{i} " for i in range(10))
    assert out.ttft > 0 and all(g > 0 for g in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))


def test_crlf_comments_and_split_events_are_parsed_alike(scripted):
    out = _send(RequestSpec(scripted.url + "/v1/completions", "openai", "scripted", "crlf", 2, 10))
    assert out.success, out.error
    assert out.output_tokens == 10 and out.prompt_len == 7 and len(out.itl) == 3
    assert out.generated_text == "".join(f"t{i} " for i in range(10))


def test_chat_role_chunk_counts_as_first(scripted):
    out = _send(RequestSpec(scripted.url + "/v1/chat/completions", "openai-chat", "scripted", "hi", 2, 6))
    assert out.success and out.output_tokens == 6
    assert len(out.itl) == 2                                          # role chunk, then 2 content chunks
    assert out.generated_text == "".join(f"t{i} " for i in range(6))


def test_http_error_and_stream_error_fail_the_request(scripted):
    out = _send(RequestSpec(scripted.url + "/v1/completions", "openai", "scripted", "fail", 2, 4))
    assert not out.success and out.error.startswith("HTTP 500") and "scripted failure" in out.error
    out = _send(RequestSpec(scripted.url + "/v1/completions", "openai", "scripted", "break", 2, 9))
    assert not out.success and "mid-stream" in out.error


def test_max_concurrency_is_respected_by_the_runner(scripted):
    """Two streams overlap because the server holds each until a second is open (before: because each
    lasted 20 ms, which a loaded machine need not honour). Mutation caught: ``run_requests`` without its
    semaphore and ``make_client`` without its connection cap (bench/runner.py; either alone still limits
    to 2) -> all 8 open at once."""
    specs = [RequestSpec(scripted.url + "/v1/completions", "openai", "scripted", f"p{i}", 2, 6) for i in range(8)]

    async def go():
        traffic = TrafficConfig(max_concurrency=2, num_warmups=2, disable_tqdm=True)
        async with make_client(2) as http:
            await run_warmups(http, specs, traffic)
            return await run_requests(http, specs, traffic)
    scripted.peak, scripted.done, scripted.pair_up = 0, 0, 2 + 8        # warmups, then the requests
    try:
        outputs, duration = asyncio.run(go())
    finally:
        scripted.pair_up = 0
    assert len(outputs) == 8 and all(o.success for o in outputs)
    assert scripted.peak == 2
    assert duration > 0 and sum(o.client_queue_time > 0 for o in outputs) >= 6


def test_result_keys_equal_vllm_reference(scripted, tiny_llama):
    reference = json.loads((DATA / "vllm_bench_serve_keys.json").read_text())
    cfg = BenchConfig(base_url=scripted.url, model=str(tiny_llama), served_model_name="scripted",
                      dataset=DatasetConfig(name="random", num_prompts=4, random_input_len=16, random_output_len=5),
                      traffic=TrafficConfig(disable_tqdm=True))
    res = asyncio.run(run_bench_async(cfg))
    assert set(res.result) - {"pdserve"} == set(reference["keys"])
    assert res.result["completed"] == 4 and res.result["total_output_tokens"] == 20
    assert res.result["pdserve"]["kv"] == {}                         # not a pdserve server: empty, no error
    assert res.result["pdserve"]["scrape_warnings"]                  # its /metrics is missing, and said so
    detailed = asyncio.run(run_bench_async(BenchConfig(**{**cfg.__dict__, "save_detailed": True,
                                                          "percentile_metrics": ("ttft", "tpot", "itl", "e2el")})))
    e2el = {"mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms"}
    expected = set(reference["keys"]) | set(reference["save_detailed_extra_keys"]) | e2el
    assert set(detailed.result) - {"pdserve"} == expected


def test_generated_history_carries_each_sessions_answers(scripted):
    """``--multi-round-history generated``: round r's prompt is the session's round r-1 prompt + the text the
    server streamed back + round r's question; a failed answer continues the history with nothing; sessionless
    requests go as they are. Mutations caught: the runner ignoring sessions (round 1 sent its dataset prompt),
    threading another session's answer, or keeping the round-0 prompt instead of the last one."""
    url = scripted.url + "/v1/completions"
    specs = [RequestSpec(url, "openai", "scripted", f"sys u{u} q0 ", 2, 2 + u, round=0, session=u) for u in (0, 1)]
    specs += [RequestSpec(url, "openai", "scripted", "dataset text", 2, 1, round=r, session=u, turn=f"q{r}u{u} ")
              for r in (1, 2) for u in (0, 1)]
    specs += [RequestSpec(url, "openai", "scripted", "fail", 2, 1, round=1, session=7, turn="x"),
              RequestSpec(url, "openai", "scripted", "dataset text", 2, 1, round=2, session=7, turn="after ")]

    async def go():
        async with make_client(None) as http:
            return await run_requests(http, specs, TrafficConfig(disable_tqdm=True))
    scripted.prompts.clear()
    outputs, _ = asyncio.run(go())
    assert [(o.round, o.success) for o in outputs] == [(0, True)] * 2 + [(1, True)] * 2 + [(1, False)] + \
        [(2, True)] * 3
    u0 = [p for p in scripted.prompts if p.startswith("sys u0")]
    u1 = [p for p in scripted.prompts if p.startswith("sys u1")]
    assert sorted(u0, key=len) == ["sys u0 q0 ", "sys u0 q0 t0 t1 q1u0 ", "sys u0 q0 t0 t1 q1u0 t0 q2u0 "]
    assert sorted(u1, key=len) == ["sys u1 q0 ", "sys u1 q0 t0 t1 t2 q1u1 ", "sys u1 q0 t0 t1 t2 q1u1 t0 q2u1 "]
    assert "dataset text" not in scripted.prompts                   # every later round was rebuilt
    assert "fail" in scripted.prompts and "failafter " in scripted.prompts   # the failed answer added nothing


def test_generated_history_goes_to_a_chat_server_as_messages(scripted):
    """openai-chat: a later round is the session's messages -- user, the streamed answer as assistant, the new
    question as user -- as a chat client (and LMCache's multi-round QA) sends them, so the server renders its
    template around each turn and the answer's KV is a prefix of the next round's (review 40: it went as one user
    message, whose template parts right after the first question)."""
    url = scripted.url + "/v1/chat/completions"
    specs = [RequestSpec(url, "openai-chat", "scripted", "system. q0?", 2, 2, round=0, session=0),
             RequestSpec(url, "openai-chat", "scripted", "dataset", 2, 1, round=1, session=0, turn=" q1?"),
             RequestSpec(url, "openai-chat", "scripted", "dataset", 2, 3, round=2, session=0, turn=" q2?")]

    async def go():
        async with make_client(None) as http:
            return await run_requests(http, specs, TrafficConfig(disable_tqdm=True))
    scripted.chats.clear()
    outputs, _ = asyncio.run(go())
    assert all(o.success for o in outputs)
    assert [[(m["role"], m["content"]) for m in chat] for chat in scripted.chats] == [
        [("user", "system. q0?")],
        [("user", "system. q0?"), ("assistant", "t0 t1 "), ("user", " q1?")],
        [("user", "system. q0?"), ("assistant", "t0 t1 "), ("user", " q1?"), ("assistant", "t0 "), ("user", " q2?")]]
