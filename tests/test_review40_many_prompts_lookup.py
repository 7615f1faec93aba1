"""Review 40: a completions request with many prompts waits for one store lookup per prompt, one after another.

proxy/kv_routing.py:134 (``plan``): ``hints = tuple([await self._hint(req, i) for i in range(len(req.prompts))])``
-- each prompt's lookup awaits the previous one's, each bounded by ``STORE_TIMEOUT_S`` (2 s) on its own. The module
promises "The store is asked once per request, with one batched lookup" and "a request waits at most
``STORE_TIMEOUT_S`` for its lookup"; a slow store (answering, each answer under the timeout: a loaded Redis, a daemon
busy copying) makes a 64-prompt request (``MAX_PROMPTS``) wait up to 64 x 2 s = 128 s before its first prefill call,
and keeps the proxy's single lookup thread busy meanwhile. (The decision for several prompts is ``prefill`` anyway:
the lookups only feed the prefill pool's hints.)

Fixed: only a one-prompt request asks the store (several prompts go to a prefill node whatever it holds).
Correct: a request's routing waits at most about ``STORE_TIMEOUT_S`` whatever its number of prompts (one batched or
concurrent lookup). Reproduced with a real redis-server made slow by another client running 0.1 s Lua scripts
back to back (each lookup waits for one), the proxy's Redis lookup path (``--kv-store redis://``).
"""

from __future__ import annotations

import asyncio
import threading
import time

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from pdserve.kvstore.keys import chunk_keys
from pdserve.proxy import kv_routing
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics

SPACE = {"fingerprint": "ef" * 16, "chunk_tokens": 8, "num_layers": 2}
PROMPTS = 64                                   # MAX_PROMPTS
BUSY_LUA = ("local s = redis.call('TIME') local t0 = s[1] * 1000000 + s[2] while true do local n = redis.call('TIME') "
            "if n[1] * 1000000 + n[2] - t0 > 100000 then break end end return 1")


def test_a_many_prompt_request_waits_for_about_one_lookup(own_redis, monkeypatch):
    monkeypatch.setattr(kv_routing, "STORE_TIMEOUT_S", 1.0)     # each lookup (<= ~0.2 s here) well inside it
    metrics = ProxyMetrics()
    kv = KVRouting(metrics, store_url=own_redis.url, redis_prefix="r40mp:")
    kv.store_space, kv.block_size = dict(SPACE), 4
    prompts = []
    for p in range(PROMPTS):
        ids = [p * 100 + i for i in range(32)]
        prompts.append(Prompt(ids, chunk_keys(ids, 8, SPACE["fingerprint"], include_partial=True)))
    req = ProxyRequest("/v1/completions", {}, prompts, False, 8)

    stop, stopped_once = threading.Event(), threading.Event()
    busy = own_redis.client()

    def stutter():                          # the server answers, slowly: another client's 0.1 s scripts in a row
        while not stop.is_set():
            busy.eval(BUSY_LUA, 0)
            stopped_once.set()

    async def main() -> float:
        await kv.plan(ProxyRequest("/v1/completions", {}, prompts[:1], False, 8), [])   # connected, answering
        thread.start()
        assert stopped_once.wait(5)
        start = time.monotonic()
        await kv.plan(req, [])
        took = time.monotonic() - start
        await kv.stop()
        return took

    thread = threading.Thread(target=stutter, daemon=True)
    try:
        took = asyncio.run(main())
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        busy.close()
    errors = metrics.store_lookups.labels("error")._value.get()
    assert errors == 0, "precondition: the slow store answered every lookup in time"
    assert took < 1.5 * kv_routing.STORE_TIMEOUT_S, \
        f"routing a {PROMPTS}-prompt request took {took:.1f} s (store errors {errors}): one lookup per prompt in turn"
