"""The proxy's side of the nodes' KV events: one ZMQ SUB per node, verified batches into ``node.kv``.

Who calls what (all on the proxy's event loop):

    ProxyState.on_card(node, card)   subscriber.watch(node, endpoint,    a node's /v1/models names its endpoints
                                                      replay)            (again after a restart: a new port)
    app lifespan                     await subscriber.stop()
    on subscribing, after a gap      replay: a signed request to the node's replay socket -> node.kv.restore
                                     (``engine.kv.kv_replay``): what it cached before counts at once
    per message                      decode_batch (MAC, bounds) -> node.kv.apply -> metrics

A message that fails its MAC or does not decode, or names another endpoint than the one it arrived from (a batch
of another node relayed by whoever took this node's port), is dropped and counted (``outcome="forged"``); one that
replays an old epoch or sequence is dropped as ``stale`` (``kv_state``). Watching a new endpoint for a node forgets what the
old one said; a new replay endpoint for the same events endpoint (the node restarted on a fixed
``--kv-events-port``) is asked from then on. A replay that fails (no answer in ``REPLAY_TIMEOUT_S``, a bad MAC) is
counted (``replay_failed``) and routing goes on with the live events; replays of one node are at least
``REPLAY_MIN_INTERVAL_S`` apart. The sockets only connect (to 127.0.0.1 endpoints the nodes bind), both (the SUB
and the replay DEALER) as CURVE clients of the nodes' key pair, which follows from the token
(``engine.kv.kv_curve``): whoever sits on such a port without the token never completes the handshake, so
nothing it sends reaches the proxy; see docs/threat-model.md. A node whose socket refuses the SUB's handshake (on
another cluster token; or someone else on its port) sends nothing the proxy could count, so the SUB's monitor
reports it: one warning and one ``outcome="refused"`` per run of refusals (ZMQ retries every ~0.1 s), and an info
line when the node accepts again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import zmq
import zmq.asyncio
import zmq.utils.monitor

from pdserve.engine.kv.kv_curve import connect_to, server_keys
from pdserve.engine.kv.kv_events import decode_batch, events_key
from pdserve.engine.kv.kv_replay import MAX_REPLY_BYTES, NONCE_BYTES, decode_reply, replay_key, request_frames
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 2 << 20
REPLAY_TIMEOUT_S = 2.0
REPLAY_MIN_INTERVAL_S = 1.0
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class EventSubscriber:
    def __init__(self, token: str, metrics: ProxyMetrics):
        """``token``: the cluster's (the MAC keys and the nodes' CURVE key follow from it)."""
        self._key, self._metrics = events_key(token), metrics
        self._replay_key = replay_key(self._key)
        self._curve = server_keys(token)
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}    # node url -> (endpoint, reader)
        self._replays: dict[str, str | None] = {}                 # node url -> its replay endpoint (the card's)

    def watch(self, node: Node, endpoint: str, replay: str | None = None) -> None:
        """Read ``node``'s events from ``endpoint`` (a no-op if already so), its state first from ``replay``."""
        current = self._tasks.get(node.url)
        if current is not None and current[0] == endpoint:
            if self._replays.get(node.url) != replay:     # restarted on the same events port: a new replay port
                self._replays[node.url] = replay
                node.kv.needs_replay = True               # (a replay that went to the old one failed)
            return
        self._replays[node.url] = replay
        if current is not None:
            current[1].cancel()
        node.kv.forget()
        self._metrics.node_cached_blocks.labels(node.role, node.url).set(0)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        connect_to(sock, self._curve)
        sock.connect(endpoint)
        self._tasks[node.url] = (endpoint, asyncio.ensure_future(self._read(node, sock, endpoint)))
        logger.info("KV events of %s node %s from %s", node.role, node.url, endpoint)

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._replays.clear()
        self._ctx.term()

    async def _read(self, node: Node, sock, endpoint: str) -> None:
        last_replay = -REPLAY_MIN_INTERVAL_S
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        handshakes = asyncio.ensure_future(self._handshakes(node, monitor, endpoint))
        try:
            node.kv.needs_replay = True
            while True:
                replay = self._replays.get(node.url)
                if replay and node.kv.needs_replay:
                    await asyncio.sleep(max(0.0, last_replay + REPLAY_MIN_INTERVAL_S - time.monotonic()))
                    last_replay = time.monotonic()
                    await self.replay(node, endpoint, replay)
                self.handle(node, await sock.recv_multipart(), endpoint)
        finally:
            handshakes.cancel()
            sock.close()
            monitor.close()                   # here, not in the task: stop() terms the context right after

    async def _handshakes(self, node: Node, monitor, endpoint: str) -> None:
        """Says when ``node``'s socket refuses the SUB's handshake, once per run of refusals, and when it accepts
        again (the retries themselves are ZMQ's)."""
        refused = False
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())["event"]
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED and not refused:
                logger.warning("%s node %s's KV-event socket %s refused the proxy's handshake: it is on another "
                               "cluster token (PDSERVE_KV_AUTH_TOKEN), or not the node; its events are not read "
                               "until it accepts", node.role, node.url, endpoint)
                self._metrics.kv_events.labels("refused").inc()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and refused:
                logger.info("%s node %s's KV-event socket %s accepts the proxy's handshake again", node.role,
                            node.url, endpoint)
            refused = event != zmq.EVENT_HANDSHAKE_SUCCEEDED

    async def replay(self, node: Node, endpoint: str, replay: str) -> str:
        """Ask ``node``'s replay socket for its whole block set (live batches wait in the SUB socket meanwhile);
        returns the outcome counted (replayed, stale, replay_failed)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES + 1024)
        connect_to(sock, self._curve)
        nonce = os.urandom(NONCE_BYTES)
        try:
            sock.connect(replay)
            await sock.send_multipart(request_frames(self._replay_key, nonce))
            if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                raise ValueError(f"no answer in {REPLAY_TIMEOUT_S:.0f} s")
            outcome = node.kv.restore(decode_reply(self._replay_key, await sock.recv_multipart(), nonce, endpoint))
        except ValueError as exc:
            logger.warning("KV replay of %s node %s from %s failed: %s; following its live events only", node.role,
                           node.url, replay, exc)
            node.kv.needs_replay, outcome = False, "replay_failed"
        finally:
            sock.close()
        self._metrics.kv_events.labels(outcome).inc()
        self._metrics.node_cached_blocks.labels(node.role, node.url).set(len(node.kv.blocks))
        return outcome

    def handle(self, node: Node, frames: list[bytes], endpoint: str) -> str:
        """One message from ``node``'s socket at ``endpoint``; returns its outcome (accepted, reset, stale, forged)."""
        try:
            batch = decode_batch(self._key, frames)
            if batch.endpoint != endpoint:
                raise ValueError(f"a batch sent on {batch.endpoint or 'an unnamed socket'!r} arrived on {endpoint!r} "
                                 "(relayed from another node's socket, or a node older than the proxy)")
        except ValueError as exc:
            logger.warning("dropped a KV-event message on %s node %s's socket: %s", node.role, node.url, exc)
            outcome = "forged"
        else:
            outcome = node.kv.apply(batch)
        self._metrics.kv_events.labels(outcome).inc()
        if outcome == "reset":
            logger.info("%s node %s: KV-event state reset (restart, lost events or cleared cache)", node.role,
                        node.url)
        self._metrics.node_cached_blocks.labels(node.role, node.url).set(len(node.kv.blocks))
        return outcome
