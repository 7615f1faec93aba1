"""Tokenization and chat templating for requests: limited before, bounded during, off the event loop.

One ``PromptWork`` per process (node: ``NodeState.prompts``; proxy: ``ProxyState.prompts``):

    work = PromptWork(tokenizer, limits, max_model_len=lambda: 2048)
    ids = await work.encode(text, param="prompt")                # raises APIError
    ids_each = await work.encode_prompts(["text", [1, 2, 3]])    # one request's prompts (text or ids)
    ids = await work.chat(message_dicts, add_generation_prompt)

Order, per prompt: (1) the character limit -- a prompt longer than ``max_model_len`` x the longest
token of the vocabulary cannot fit, so it is refused before a token is made (``checks.check_prompt_chars``);
(2) a request whose text prompts have at most ``inline_chars`` characters in all (``INLINE_ENCODE_CHARS``)
is encoded on the event loop itself, while the hop to a worker thread and back waits for the GIL behind the
loop -- in a burst of 32 prompts of 512 tokens (``devbench/compare_vllm.sh``'s workload, traced) the hop held
prompts 20-35 ms from the engine. The budget is per request, not per prompt (64 prompts of 4,096 characters
held the loop 0.3-0.5 s, a hostile review found), so one request holds the loop for at most one budget's
encode: ~1.5 ms of ordinary text at ~0.4 us a character, 5-7 ms of the costliest (4-byte emoji) -- bounded
by the character count, so no deadline is needed there; (3) a larger request, and every chat template, runs
in one of ``limits.tokenize_workers`` threads, so the event loop keeps serving other clients; (4) the caller
waits at most ``--tokenize-timeout``: past it the client gets 503 with
``Retry-After`` (the thread finishes on its own -- the character limit bounds it, and a chat template
stops itself at the same deadline, see ``engine.text.chat_template``). ``max_model_len`` is a callable
because the proxy learns it from the nodes' ``/v1/models``; ``None`` skips step (1).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server.checks import check_prompt_chars
from pdserve.engine.server.errors import APIError, bad_request
from pdserve.engine.text.chat_template import TemplateLimitError, TemplateLimits
from pdserve.engine.text.tokenizer import apply_chat_template, max_chars_per_token

T = TypeVar("T")
INLINE_ENCODE_CHARS = 4096     # text prompts up to this many characters are encoded on the event loop


class PromptWork:
    def __init__(self, tokenizer, limits: RequestLimits, max_model_len: Callable[[], int | None],
                 inline_chars: int = INLINE_ENCODE_CHARS):
        self.tokenizer, self.limits, self._max_model_len = tokenizer, limits, max_model_len
        self.inline_chars = inline_chars
        self.chars_per_token = max_chars_per_token(tokenizer)
        self._pool = ThreadPoolExecutor(limits.tokenize_workers, thread_name_prefix="tokenize")

    @property
    def max_prompt_chars(self) -> int | None:
        max_model_len = self._max_model_len()
        return None if max_model_len is None else max_model_len * self.chars_per_token

    def check_chars(self, num_chars: int, param: str) -> None:
        check_prompt_chars(num_chars, self._max_model_len(), self.chars_per_token, param)

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_chars(len(text), param)
        return await self._encode(text, add_special_tokens, len(text) <= self.inline_chars, param)

    async def encode_prompts(self, prompts: list, param: str = "prompt") -> list[list[int]]:
        """One request's prompts (text, or token ids passed through): every character limit before any
        tokenizing, then on the loop only if the texts together fit ``inline_chars``."""
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_chars(len(text), param)
        inline = sum(map(len, texts)) <= self.inline_chars
        return [await self._encode(p, True, inline, param) if isinstance(p, str) else list(p) for p in prompts]

    async def _encode(self, text: str, add_special_tokens: bool, inline: bool, param: str) -> list[int]:
        if inline:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self.run(param, lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        tool_chars = len(json.dumps(tools)) if tools else 0            # the template writes them out, about this big
        self.check_chars(tool_chars, "tools")
        self.check_chars(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) + tool_chars,
                         "messages")
        limits = TemplateLimits(deadline_s=0.9 * self.limits.tokenize_timeout_s,   # its 400 before our 503
                                max_chars=self.max_prompt_chars or TemplateLimits.max_chars)

        def render() -> list[int]:
            try:
                return apply_chat_template(self.tokenizer, messages, add_generation_prompt, limits, tools)
            except APIError:
                raise
            except Exception as exc:   # jinja errors, template limits, no template: the request cannot be rendered
                raise bad_request(f"cannot apply the chat template: {_describe(exc)}", "messages") from None

        return await self.run("messages", render)

    async def decode(self, ids: list[int]) -> str:
        """/detokenize: up to ``MAX_TOKEN_IDS`` ids, in a worker thread with the same deadline."""
        return await self.run("tokens", lambda: self.tokenizer.decode(ids))

    async def run(self, param: str, work: Callable[[], T], doing: str = "tokenizing") -> T:
        """``work()`` in a worker thread, waited for at most ``--tokenize-timeout`` (then 503 naming ``param``)."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, work)
        try:
            return await asyncio.wait_for(future, self.limits.tokenize_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"{doing} the {param} took longer than --tokenize-timeout "
                                f"{self.limits.tokenize_timeout_s:g} s; try again later or send less",
                           param=param, headers={"Retry-After": "1"}) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _describe(exc: Exception) -> str:
    if isinstance(exc, TemplateLimitError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
