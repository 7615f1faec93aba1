"""Routing by cache: what the store and each node hold of a prompt, and whether it needs a prefill node at all.

Who calls what:

    health, once a node's /v1/models was read     kv.on_card(node, card) -> a new ``Routing`` for the gate
                                                  (the store's key space), and the node's KV events watched
    orchestrate, per request                      route = await kv.plan(req, decode_nodes, pool.picks_by_cache)
                                                  route.decision: "prefill" | "store_hit" | "decode_local"
                                                  route.hint(i): the ``KVHint`` the kv_aware policy scores with
    app lifespan                                  await kv.stop()

The store is asked once per one-prompt request (several prompts: never, see ``_stored_tokens``), with one batched
``lookup`` of the prompt's chunk keys (no data): the keys
are the store's own (``kvstore.keys.chunk_keys`` with the nodes' fingerprint, chunk size and the request's
``cache_salt``, the last partial chunk included, as the prefill node publishes them). The proxy talks to the
daemon as any client does, with the cluster token (``--kv-store tcp://``, PDSERVE_KV_AUTH_TOKEN); a cluster whose
nodes embed their stores and share Redis has no daemon: the proxy asks that Redis (``--kv-store redis://``, the
nodes' ``--kv-redis-prefix``) with one pipeline of EXISTS on the layer objects' keys. A store that fails
or is slow is a miss (counted), never a failed request. Lookups run on one thread of their own (the client
serves one request at a time); a request waits at most ``STORE_TIMEOUT_S`` for its lookup; after a failure or a
timeout requests route without it (``skipped`` in ``pdserve_proxy_store_lookups``) while one lookup in the
background, every ``STORE_RETRY_S``, tells when it answers again: a hung store costs the requests of one timeout,
not a queue of timeouts.

The decision, for a request with one prompt (several prompts, a prefill-only answer, prompt logprobs: "prefill"):
    store_hit      the store holds all but the last block (``--no-skip-prefill-on-store-hit`` turns it off)
    decode_local   the tokens neither the store nor the best decode node's prefix cache holds are fewer than
                   ``--local-prefill-threshold`` (a short prompt, or a next turn of a chat the node just served);
                   "best" is the node ``kv_aware`` will pick (its cost weighs load too: a busy warm node may lose
                   to a cold one, whose cache then counts), the worst when the decode policy is not ``kv_aware``
    prefill        otherwise: prefill node, then decode node
Both skips send the decode node the prompt without ``kv_transfer_params``: it looks the prompt up in the store,
loads what is there, computes the rest and samples the first token itself (draw 0 of seeded sampling, as the
prefill node would have), so the answer is the one the prefill path gives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.engine.kv.kv_events import events_key
from pdserve.proxy.inputs import ProxyRequest, Routing
from pdserve.proxy.kv_events import EventSubscriber
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node
from pdserve.proxy.policies import KVAware, KVHint

logger = logging.getLogger(__name__)
STORE_TIMEOUT_S = 2.0
STORE_RETRY_S = 5.0          # a failing store is probed (in the background) this often
MAX_PENDING_LOOKUPS = 8      # lookups queued beyond this are misses (a slow store, not a failing one)
NO_SKIP_FIELDS = ("prompt_logprobs", "echo")     # the prefill node computes the prompt's logprobs


@dataclass(frozen=True)
class Route:
    decision: str
    hints: tuple[KVHint | None, ...]          # per prompt
    store_tokens: int = 0
    decode_local_tokens: int = 0

    def hint(self, index: int = 0) -> KVHint | None:
        return self.hints[index] if self.hints else None

    def describe(self) -> dict:
        """What ``usage.kv_transfer.route`` says."""
        return {"decision": self.decision, "store_hit_tokens": self.store_tokens,
                "decode_local_hit_tokens": self.decode_local_tokens}


class KVRouting:
    def __init__(self, metrics: ProxyMetrics, store_url: str | None = None, token: str = "",
                 local_prefill_threshold: int = 0, skip_on_store_hit: bool = True, redis_prefix: str = "pdkv:"):
        self._metrics, self._store_url = metrics, store_url
        self._redis_prefix = redis_prefix if store_url and not store_url.startswith("tcp://") else None
        self._prefix_mismatch: dict[str, bool] = {}   # node url -> its card named another Redis prefix
        self.threshold, self.skip_on_store_hit = local_prefill_threshold, skip_on_store_hit
        self._key = events_key(token) if token else None
        self.events = EventSubscriber(token, metrics) if token else None
        self._client = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._failing = False                       # the last lookup failed: requests skip it, a probe retries
        self._down_until = 0.0                      # monotonic: no probe before it
        self._pending = 0                           # lookups submitted and not finished
        if store_url:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-store-lookup")
            self._client = _store_client(store_url, token, redis_prefix)
        self.store_space: dict | None = None       # the nodes' {fingerprint, chunk_tokens, num_layers}
        self.block_size = 0
        self._lookup_failed = False

    def on_card(self, node: Node, card: dict, routing: Routing) -> Routing:
        """A node's model card was read: watch its events, learn the store's key space; the gate's new routing."""
        kv = card.get("kv") if isinstance(card.get("kv"), dict) else {}
        if self.events is not None and isinstance(kv.get("events"), str):
            self.events.watch(node, kv["events"], kv["replay"] if isinstance(kv.get("replay"), str) else None)
        if isinstance(kv.get("block_size"), int) and kv["block_size"] > 0:
            self.block_size = kv["block_size"]
        if self._redis_prefix is not None and isinstance(kv.get("redis_prefix"), str):
            self._check_redis_prefix(node, kv["redis_prefix"])
        store = kv.get("store") if _valid_store_space(kv.get("store")) else None
        if store is not None and self.store_space is None:
            self.store_space = store
        elif store is not None and store != self.store_space:
            logger.warning("node %s's store key space %s differs from %s: its KV is not routed by", node.url,
                           store, self.store_space)
        if self.store_space is not None and self._store_url:
            routing = Routing(self.store_space["chunk_tokens"], self.store_space["fingerprint"], store=True)
        if self._key is not None and self.block_size:
            routing = dataclasses.replace(routing, block_size=self.block_size, events_key=self._key)
        return routing

    def _check_redis_prefix(self, node: Node, theirs: str) -> None:
        """The node writes Redis under ``theirs``: another prefix than ours means every lookup misses -- say so."""
        mismatch = theirs != self._redis_prefix
        if mismatch and not self._prefix_mismatch.get(node.url):
            logger.warning("%s node %s stores in Redis under the prefix %r, the proxy looks up %r "
                           "(--kv-redis-prefix): no prompt will be found in the store", node.role, node.url, theirs,
                           self._redis_prefix)
        self._prefix_mismatch[node.url] = mismatch
        self._metrics.redis_prefix_mismatch.labels(node.role, node.url).set(1 if mismatch else 0)

    @property
    def active(self) -> bool:
        """Anything to decide with: a store, KV events or a threshold (else ``orchestrate`` skips ``plan``)."""
        return bool(self._store_url or self._key or self.threshold)

    async def plan(self, req: ProxyRequest, decode_nodes: list[Node] | Callable[[], list[Node]],
                   best_is_picked: bool = True) -> Route:
        """``decode_nodes``: the healthy decode nodes, or what gives them -- read after the store lookup, which
        may take a while (a node may leave meanwhile). ``best_is_picked``: the decode pool's policy is
        ``kv_aware``, and the node it will pick for this hint (the same cost, cache and load, right after) is the
        one whose prefix cache counts; else any of them may get it, and a decode node's cache counts only as far
        as all of them hold it. A retry on another node asks ``skips_on`` again."""
        stored = await self._stored_tokens(req.prompts)
        hints = tuple(self._hint(prompt, tokens) for prompt, tokens in zip(req.prompts, stored))
        decode_nodes = decode_nodes() if callable(decode_nodes) else decode_nodes
        first = hints[0]
        store = first.store_tokens if first else 0
        if first is None or not decode_nodes:
            local = 0
        elif best_is_picked:
            local = first.local_tokens(KVAware().choose(decode_nodes, req.chunk_keys, first))
        else:
            local = min(first.local_tokens(n) for n in decode_nodes)
        return Route(self._decide(req, store, local), hints, store, local)

    def skips_on(self, route: Route, req: ProxyRequest, node: Node) -> bool:
        """Whether ``node`` may take the request without a prefill node, as ``route`` decided: a store hit on any
        node; ``decode_local`` where this node's cache (or the store) leaves under the threshold to compute -- the
        planned node, not a cold one a retry lands on."""
        if route.decision != "decode_local":
            return route.decision == "store_hit"
        hint = route.hint()
        local = hint.local_tokens(node) if hint is not None else 0
        return len(req.prompt_ids) - max(route.store_tokens, local) < self.threshold

    def _decide(self, req: ProxyRequest, store: int, local: int) -> str:
        if len(req.prompts) != 1 or req.prefill_only or \
                any(_asked(f, req.body.get(f)) for f in NO_SKIP_FIELDS):
            return "prefill"
        n = len(req.prompt_ids)
        if self.skip_on_store_hit and store > 0 and store >= n - max(self.block_size, 1):
            return "store_hit"
        if n - max(store, local) < self.threshold:
            return "decode_local"
        return "prefill"

    def _hint(self, prompt, store_tokens: int) -> KVHint | None:
        if not prompt.block_hashes and not self._routes_by_store:
            return None                              # nothing known yet: kv_aware is least_loaded
        return KVHint(len(prompt.ids), self.block_size, prompt.block_hashes, store_tokens)

    @property
    def _routes_by_store(self) -> bool:
        return self.store_space is not None and bool(self._store_url)

    async def _stored_tokens(self, prompts) -> list[int]:
        """Per prompt, the leading tokens whose every layer the store holds (0 when it cannot tell or did not
        ask). Only a one-prompt request asks, once, waiting at most ``STORE_TIMEOUT_S``: several prompts go to a
        prefill node whatever the store holds, and a node-independent store share hardly moves which one (their
        nodes' caches and load still do) -- one lookup each would wait up to ``MAX_PROMPTS`` x the timeout."""
        out = [0] * len(prompts)
        if not (self._routes_by_store and len(prompts) == 1 and prompts[0].chunk_keys):
            return out
        keys = prompts[0].chunk_keys
        lookups = self._metrics.store_lookups
        if self._failing or self._pending >= MAX_PENDING_LOOKUPS:
            if self._failing and time.monotonic() >= self._down_until and not self._pending:
                self._submit(keys)                  # a probe in the background: no request waits on a failing store
            lookups.labels("skipped").inc()
            return out
        try:
            chunks = await asyncio.wait_for(asyncio.wrap_future(self._submit(keys)), STORE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- a store that fails costs routing hints, not requests
            if isinstance(exc, _StoreDown):
                lookups.labels("skipped").inc()
                return out
            self._fail()
            logger.log(logging.DEBUG if self._lookup_failed else logging.WARNING, "store lookup for routing failed "
                       "(%s: %s); routing as a miss, the store asked again in the background every %.0f s (counted "
                       "in pdserve_proxy_store_lookups{outcome=\"error\"}, logged once)", type(exc).__name__, exc,
                       STORE_RETRY_S)
            self._lookup_failed = True
            lookups.labels("error").inc()
            return out
        out[0] = min(len(prompts[0].ids), chunks * self.store_space["chunk_tokens"])
        lookups.labels("hit" if out[0] else "miss").inc()
        self._metrics.store_hit_tokens.inc(out[0])
        return out

    def _submit(self, keys: list[str]) -> concurrent.futures.Future:
        self._pending += 1
        future = self._pool.submit(self._lookup, keys)
        future.add_done_callback(self._done)
        return future

    def _done(self, future) -> None:
        """The lookup thread, after each lookup: a failure marks the store failing, an answer healthy again."""
        self._pending -= 1          # plain stores under the GIL, read by the event loop
        error = None if future.cancelled() else future.exception()
        if error is None and not future.cancelled():
            self._failing = False
        elif error is not None and not isinstance(error, _StoreDown):
            self._fail()

    def _fail(self) -> None:
        self._failing, self._down_until = True, time.monotonic() + STORE_RETRY_S

    def _lookup(self, keys: list[str]) -> int:
        """The lookup thread: one lookup, unless the store failed while this one was queued."""
        if time.monotonic() < self._down_until:
            raise _StoreDown()
        return self._client.lookup(keys, self.store_space["num_layers"])

    async def stop(self) -> None:
        if self.events is not None:
            await self.events.stop()
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _store_client(url: str, token: str, redis_prefix: str):
    """What ``lookup(chunk_keys, num_layers)`` is asked of: the daemon (tcp://, with the token), or the nodes'
    shared Redis itself (one pipeline of EXISTS on the keys ``RedisTier`` writes, under the nodes' prefix)."""
    if url.startswith("tcp://"):
        from pdserve.kvstore.client import DaemonClient

        return DaemonClient(url, token, shm_bytes=0, timeout_s=STORE_TIMEOUT_S)
    from pdserve.kvstore.redis_tier import RedisTier

    return RedisTier(url, redis_prefix, timeout_s=STORE_TIMEOUT_S)


class _StoreDown(Exception):
    """A lookup that waited in the queue while another found the store failing: not asked."""


def _asked(field: str, value) -> bool:
    """``prompt_logprobs`` is asked unless absent or null: 0 asks (each prompt token's own logprob), and so does
    ``false``, which the node reads as 0. ``echo`` is asked when true (a false-looking value that the node reads
    as false costs a prefill node, nothing else)."""
    return value is not None if field == "prompt_logprobs" else bool(value)


def _valid_store_space(store) -> bool:
    """A node card's ``kv.store``: {fingerprint: 32 hex chars, chunk_tokens: int > 0, num_layers: int > 0}."""
    return isinstance(store, dict) and isinstance(store.get("fingerprint"), str) and \
        len(store["fingerprint"]) == 32 and all(isinstance(store.get(k), int) and store[k] > 0
                                               for k in ("chunk_tokens", "num_layers"))
