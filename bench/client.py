"""One streamed OpenAI request, timed the way ``vllm bench serve`` times it.

Called by ``runner`` for every request (and by ``overhead`` for the decode leg):

    out = await send(http, RequestSpec(api_url, "openai", model, prompt, prompt_len, output_len, ...))

``http`` is one shared ``aiohttp.ClientSession`` (``runner.make_client``; aiohttp, as ``vllm bench
serve`` uses; the httpx client before it spent ~2.6x the CPU per request, bench/README.md). The
body asks for ``stream: true`` and ``stream_options.include_usage``; the SSE body is read line by
line (``resp.content``; ``\n`` or ``\r\n`` endings) and each ``data:`` event is timestamped when
its line arrives. Per event: one ``json.loads``, nothing else (no tokenizing).
Events with non-empty ``choices`` are token chunks (TTFT, ITL, latency); the usage event gives
``completion_tokens`` and ``prompt_tokens``; an ``error`` event (a proxy's broken stream) fails the
request. A non-200 answer fails it with the status and the body's first 300 characters.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.metrics import RequestOutput

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestSpec:
    api_url: str                      # base URL + endpoint
    backend: str                      # "openai" (completions) or "openai-chat"
    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)    # temperature, kv_transfer_params, ...
    headers: dict[str, str] = field(default_factory=dict)
    round: int = 0
    session: int = -1                 # multi-round generated history: the user, and the text this round adds
    turn: str = ""                    # after the previous answer (runner.py builds the prompt)
    messages: tuple[tuple[str, str], ...] = ()   # ... and the conversation as (role, text) turns: openai-chat
                                                  # sends them as its messages (else one user message: prompt)


def build_body(spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model, "stream": True, "stream_options": {"include_usage": True}}
    if spec.backend == "openai-chat":
        turns = spec.messages or (("user", spec.prompt),)
        body.update(messages=[{"role": role, "content": text} for role, text in turns],
                    max_completion_tokens=spec.output_len)
    else:
        body.update(prompt=spec.prompt, max_tokens=spec.output_len)
    if spec.ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.extra_body)
    return body


async def send(http: aiohttp.ClientSession, spec: RequestSpec) -> RequestOutput:
    out = RequestOutput(prompt_len=spec.prompt_len, round=spec.round)
    out.start_time = start = time.perf_counter()
    try:
        async with http.post(spec.api_url, json=build_body(spec), headers=spec.headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                out.error = f"HTTP {resp.status}: {body[:300]}"
                return out
            await _consume(resp, spec.backend, out, start)
    except Exception:                  # noqa: BLE001 -- any failure is this request's, recorded, not raised
        out.success, out.error = False, traceback.format_exc(limit=3)
    return out


async def _consume(resp: aiohttp.ClientResponse, backend: str, out: RequestOutput, start: float) -> None:
    last = start
    first = False
    texts: list[str] = []
    async for line in resp.content:    # bytes, one line each, its b"\n" (or b"\r\n") kept
        if not line.startswith(b"data:"):
            continue                   # blank separators, SSE comments (":ping"), event names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        now = time.perf_counter()
        data = json.loads(payload)
        if data.get("error"):
            out.error = f"stream error event: {json.dumps(data['error'])[:300]}"
            return
        if choices := data.get("choices"):
            if first:
                out.itl.append(now - last)
            else:
                first, out.ttft = True, now - start
            last = now
            texts.append(_chunk_text(choices[0], backend))
        elif usage := data.get("usage"):
            out.output_tokens = usage.get("completion_tokens") or 0
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = usage["prompt_tokens"]
            out.kv_transfer = usage.get("kv_transfer")
    out.generated_text = "".join(texts)
    out.latency = last - start
    out.success = first
    if not first:
        out.error = "Never received a valid chunk to calculate TTFT."


def _chunk_text(choice: dict, backend: str) -> str:
    if backend == "openai-chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""
