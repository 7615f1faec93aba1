"""Limits before work, without processes: JSON nesting and body size (``BodyLimits``), the character
limit and the worker thread of tokenization (``PromptWork``), the bounded chat-template sandbox,
pydantic errors that stay one short message, and the sampling values that used to fail a step.
Each test's docstring says what happened before its fix.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdserve.engine.checkpoints.download import SMOLLM2_CHAT_TEMPLATE
from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.runner.sampler import sample
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError
from pdserve.engine.server.errors import APIError, describe_validation_errors
from pdserve.engine.server.limits import BodyLimits, json_depth
from pdserve.engine.server.prompt_work import PromptWork
from pdserve.engine.server.protocol import MAX_PROMPTS, CompletionRequest
from pdserve.engine.text.chat_template import TemplateLimitError, TemplateLimits, render_chat
from pdserve.engine.text.tokenizer import load_tokenizer, max_chars_per_token


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


# -- JSON nesting and body size ----------------------------------------------------------------------

def _reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    return 0


TRICKY = st.text(alphabet='[]{}"\\\n\u00e9 ab', max_size=8)
JSON = st.recursive(st.none() | st.integers() | TRICKY,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=JSON, ascii_only=st.booleans())
def test_json_depth_counts_brackets_outside_strings_only(value, ascii_only):
    assert json_depth(json.dumps(value, ensure_ascii=ascii_only).encode()) == _reference_depth(value)


def _limited_app(limits: RequestLimits) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    app.add_middleware(BodyLimits, limits=limits)
    return app


async def _post(app, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/echo", **kwargs)


def test_body_limits_refuse_size_and_depth_before_the_app_reads_the_body():
    """Before: no limit at all -- a 50 MB prompt was read, parsed and tokenized; 100,000 nested
    brackets reached json.loads (RecursionError: a 500 from the proxy)."""
    app = _limited_app(RequestLimits(max_request_bytes=1000, max_json_depth=4))
    ok = asyncio.run(_post(app, content=b'{"a": [[1]], "b": "[[[[[[[["}'))
    assert ok.status_code == 200 and ok.json() == {"bytes": 29}
    big = asyncio.run(_post(app, content=b"x" * 1001))
    assert big.status_code == 413 and "--max-request-bytes is 1000" in big.json()["error"]["message"]

    async def chunks():
        for _ in range(20):
            yield b"x" * 100

    streamed = asyncio.run(_post(app, content=chunks()))
    assert streamed.status_code == 413 and "more than 1000 bytes" in streamed.json()["error"]["message"]
    deep = asyncio.run(_post(app, content=b'{"a": [[[[1]]]]}'))
    assert deep.status_code == 400 and "nests JSON 5 levels deep; the limit is 4" in deep.json()["error"]["message"]


# -- pydantic errors stay short -----------------------------------------------------------------------

def test_a_million_bad_token_ids_make_one_short_message_at_once():
    """Before: one error per id (seconds of work, a multi-megabyte 400); unions named every branch.
    "At once" is counted, not timed: validation stops at the first bad id, in one branch. Mutation caught:
    no ``fail_fast=True`` on the bounded lists (engine/server/protocol.py) -> 1,000,000 errors."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": [2**40] * 1_000_000})
    assert info.value.error_count() == 1
    message, param = describe_validation_errors(info.value.errors())
    assert message == "prompt.0: Input should be less than or equal to 2147483647 (got 1099511627776)"
    assert param == "prompt.0"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "stop": ["x" * 5000]})
    message, _ = describe_validation_errors(info.value.errors())
    assert message.startswith("stop.0: String should have at most 1024 characters (got 'xxxx") and len(message) < 200


# -- sampling values that used to fail a step ---------------------------------------------------------

@pytest.mark.parametrize("kwargs, param, words", [
    ({"seed": 2**64}, "seed", "seed must be in [-2^63, 2^64 - 1], got 18446744073709551616"),
    ({"seed": 10**5000}, "seed", "got <16610-bit integer>"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids must be >= 0, got [-1]"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty", "repetition_penalty must be in [0.001, 1000]"),
    ({"top_k": 2.5}, "top_k", "top_k must be an integer, got 2.5"),
    ({"max_tokens": True}, "max_tokens", "max_tokens must be an integer, got True"),
])
def test_sampling_params_refuse_what_a_step_cannot_run(kwargs, param, words):
    """Before: each passed construction and failed inside the engine step (generator overflow, IndexError,
    NaN probabilities), which took the engine thread down before the engine's failure isolation."""
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and words in str(info.value)


def test_a_tiny_temperature_is_greedy_and_out_of_vocabulary_bans_are_ignored():
    """Before: temperature 1e-40 divided the logits to inf and the probabilities to NaN (the request
    failed); a banned id past the vocabulary raised IndexError and -1 banned the last token."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 49] = 100.0                                        # the argmax is the last token
    tiny = [SamplingParams(temperature=1e-40, seed=1), SamplingParams(temperature=1e-6), SamplingParams(temperature=0)]
    assert all(p.greedy for p in tiny)
    out = sample(logits, tiny, [0, None, None], banned=[[50, 10**6], [], [-1]])
    assert [r.token_id for r in out] == [49, 49, 49] and all(math.isfinite(r.logprob) for r in out)


# -- tokenization: character limit, worker thread, deadline -------------------------------------------

class _SpyTokenizer:
    """The tiny tokenizer, counting encode calls and optionally blocking them until released."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner, self.gate, self.encodes = inner, gate, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kwargs):
        self.encodes += 1
        if self.gate is not None:
            self.gate.wait()
        return self.inner.encode(text, **kwargs)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer):
    """Before: a 50 MB prompt was tokenized (50 s of a core, 2.4 GB) before its length was checked."""
    spy = _SpyTokenizer(tokenizer)
    work = PromptWork(spy, RequestLimits(), lambda: 128)
    limit = 128 * max_chars_per_token(tokenizer)
    assert work.max_prompt_chars == limit
    with pytest.raises(APIError) as info:
        asyncio.run(work.encode("x" * (limit + 1)))
    assert info.value.status == 400 and f"at most {limit} can fit --max-model-len 128" in info.value.message
    with pytest.raises(APIError):
        asyncio.run(work.chat([{"role": "user", "content": "x" * (limit + 1)}], True))
    assert spy.encodes == 0
    assert asyncio.run(work.encode("hello world")) == tokenizer.encode("hello world")
    work.shutdown()


@pytest.mark.timeout(60)              # the bug below hangs the event loop: fail in a minute, not five
def test_tokenizing_runs_off_the_event_loop_and_gives_up_at_the_deadline(tokenizer):
    """A tokenization that does not end (held until the test ends): other work runs on the event loop while
    it is held -- a condition, not a count of ticks in 0.5 s -- and the caller gets 503 + Retry-After at
    --tokenize-timeout. Before: encode ran on the event loop. Mutation caught: ``PromptWork._run``
    (engine/server/prompt_work.py) calling ``work()`` on the loop -> the loop blocks (pytest-timeout).
    ``inline_chars=0``: every prompt takes the thread (by default one this short is encoded on the loop)."""
    spy = _SpyTokenizer(tokenizer, threading.Event())
    work = PromptWork(spy, RequestLimits(tokenize_timeout_s=0.5), lambda: 128, inline_chars=0)

    async def scenario():
        async def other_work() -> bool:           # done only after encode started; encode never ends
            while spy.encodes == 0:
                await asyncio.sleep(0.01)
            return not spy.gate.is_set()

        task = asyncio.create_task(other_work())
        with pytest.raises(APIError) as info:
            await work.encode("hello")
        return info.value, await asyncio.wait_for(task, 30)

    try:
        error, ran_while_held = asyncio.run(scenario())
    finally:
        spy.gate.set()
        work.shutdown()
    assert error.status == 503 and "--tokenize-timeout 0.5 s" in error.message
    assert error.headers == {"Retry-After": "1"} and ran_while_held


def test_a_short_prompt_is_encoded_on_the_event_loop_and_a_long_one_in_a_worker_thread(tokenizer):
    """Up to ``inline_chars`` characters the loop's own thread encodes (no GIL-contended hop in a burst);
    one character more goes to a tokenize thread. The ids are the tokenizer's either way. Mutation caught:
    the length test in ``PromptWork.encode`` dropped (every prompt on the loop) or inverted."""
    threads: list[str] = []

    class Where(_SpyTokenizer):
        def encode(self, text, **kwargs):
            threads.append(threading.current_thread().name)
            return super().encode(text, **kwargs)

    work = PromptWork(Where(tokenizer), RequestLimits(), lambda: 4096, inline_chars=64)
    short, long = "hello world " * 5, "hello world " * 6                   # 60 and 72 characters

    async def scenario():
        return await work.encode(short), await work.encode(long), threading.current_thread().name

    try:
        got_short, got_long, loop_thread = asyncio.run(scenario())
    finally:
        work.shutdown()
    assert got_short == tokenizer.encode(short) and got_long == tokenizer.encode(long)
    assert threads[0] == loop_thread and threads[1].startswith("tokenize")


def test_one_request_of_many_long_prompts_does_not_hold_the_event_loop(tokenizer):
    """The inline budget is per request: 64 prompts of 4,096 emoji (the costliest characters to encode, ~1 MiB,
    under every limit) go to the worker threads, so the loop keeps ticking; a hostile review measured a
    0.3-0.5 s stall when each prompt was judged alone. Mutation caught: ``encode_prompts`` passing
    ``inline=None`` (each prompt on the loop) -> the loop stalls for all 64 encodes."""
    rng = random.Random(0)
    prompts = ["".join(chr(rng.randint(0x1F300, 0x1F5FF)) for _ in range(4096)) for _ in range(MAX_PROMPTS)]
    work = PromptWork(tokenizer, RequestLimits(), lambda: 2048)

    async def scenario():
        lags, done = [], False

        async def tick():
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0)
                lags.append(time.perf_counter() - t)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        got = await work.encode_prompts(prompts)
        done = True
        await ticker
        return got, max(lags)

    try:
        got, stall = asyncio.run(scenario())
    finally:
        work.shutdown()
    assert got[0] == tokenizer.encode(prompts[0]) and len(got) == MAX_PROMPTS
    assert stall < 0.1, f"one request held the event loop {stall * 1e3:.0f} ms"


# -- the chat-template sandbox ------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, ünï"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]


@pytest.mark.parametrize("template", ["own", "smollm2"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_sandbox_renders_what_transformers_renders(tiny_llama, tiny_llama_metaspace, template,
                                                       add_generation_prompt):
    for model in (tiny_llama, tiny_llama_metaspace):
        tok = load_tokenizer(model)
        if template == "smollm2":
            tok.chat_template = SMOLLM2_CHAT_TEMPLATE
        chat = CHAT if model == tiny_llama or template == "smollm2" else CHAT[1:]   # [INST] has no system turn
        want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert render_chat(tok, chat, add_generation_prompt) == want


ABUSIVE = {        # name: (template, the limit that must stop it)
    "loops": ("{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}",
              "ran longer than 100 s"),
    "repeat": ("{{ messages[0]['content'] * 1000000000 }}", "repeats a value more than 1048576 items long"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "made a value of 2097152 items; the limit is 1048576"),
    "replace": ("{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s|replace('a','aa') %}"
                "{% endfor %}", "made a filter result of 2097152 items; the limit is 1048576"),
    "power": ("{{ 2 ** (2 ** 40) }}", "computes 2 ** 1099511627776; too large"),
    "range": ("{{ range(10 ** 9)|length }}", "asks for range(1000000000) of 1000000000 items; the limit is 16384"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    "output": ("{% for m in messages %}{% for n in messages %}{{ m.content }}{% endfor %}{% endfor %}",
               "rendered more than 1048576 characters"),
}


class _CheckClock:
    """A clock that moves one second each time it is read: the render's deadline is a count of checks."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.timeout(60)              # a limit that is never checked runs for minutes: fail in one
@pytest.mark.parametrize("name", list(ABUSIVE))
def test_a_runaway_template_stops_at_its_limits(tokenizer, name, monkeypatch):
    """Before: transformers' sandbox has no deadline and no size limit: each of these ran for minutes or
    until memory ran out, on the event loop. Each must stop at its own limit, named in the error, not at
    a clock: the deadline is 100 s, which the size limits beat by far; "loops", which only the deadline
    stops, reads a clock that moves a second per check, so it stops after 100 checks on any machine.
    Mutation caught: ``_Budget.tick`` (engine/text/chat_template.py) returning at once -> "loops" renders
    without an error (or runs into the timeout)."""
    import pdserve.engine.text.chat_template as chat_template

    if name == "loops":
        monkeypatch.setattr(chat_template, "time", _CheckClock())
    tok = load_tokenizer(tokenizer.name_or_path)
    template, limit = ABUSIVE[name]
    tok.chat_template = template
    with pytest.raises(TemplateLimitError, match=re.escape(limit)):
        render_chat(tok, [{"role": "user", "content": "x" * 1000}] * 2000, True, TemplateLimits(100.0, 1 << 20))
