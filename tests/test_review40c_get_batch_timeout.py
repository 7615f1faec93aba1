"""review40c: a TCP get batch now goes as ONE request (client_segment.GET_PARTS 8 -> 1), so the client's
``timeout_s`` -- one ``poll`` per reply, ``DaemonClient._await`` -- now bounds the WHOLE batch's transfer, where
before it bounded each eighth of it (the eight replies came back one after another, each awaited with its own
timeout). A zmq multipart reply is delivered only once its last frame is in, so a batch that takes longer than
``timeout_s`` to cross the link now fails as a whole with ``TimeoutError`` -- the engine's store client uses
``timeout_s=2.0`` (engine/kv/store_factory.py) -- although every eighth of it arrives well within the limit.

The link here is a real TCP relay between the client and a real ``KVDaemon`` that forwards the daemon's bytes at a
fixed rate (a slower network than loopback: what a remote decode node sees); the rate makes the timing
deterministic -- the batch takes ~3x the timeout, an eighth of it ~0.4x.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvstore_fixtures import TOKEN, cycled_objects, serving
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import KVDaemon

RATE = 16 << 20            # bytes/s the relay forwards daemon -> client
N, SIZE = 384, 64 << 10    # a 24 MiB batch: ~1.5 s over the relay; an eighth (48 keys) ~0.19 s
TIMEOUT_S = 0.5


class RateLimitedRelay:
    """127.0.0.1:<port> -> ``target``: client->daemon bytes as they come, daemon->client bytes at ``rate``."""

    def __init__(self, target: str, rate: int) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.rate = (host, int(port)), rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                down, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self.target)
            for src, dst, rate in ((down, up, 0), (up, down, self.rate)):
                t = threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, rate: int) -> None:
        src.settimeout(0.1)
        start, sent = time.monotonic(), 0
        try:
            while not self.stop.is_set():
                try:
                    data = src.recv(16 << 10)
                except TimeoutError:
                    start, sent = time.monotonic(), 0       # idle: the rate restarts with the next bytes
                    continue
                if not data:
                    break
                if rate:
                    sent += len(data)
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(min(ahead, 0.1))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        for t in self.threads:
            t.join(timeout=5)


@pytest.fixture
def daemon():
    with serving(KVDaemon(build_store(KVStoreConfig(cpu_bytes=N * SIZE + (64 << 20)), arena=True), port=0,
                          token=TOKEN)) as d:
        yield d


def test_a_get_batch_whose_eighths_each_arrive_within_the_timeout_is_not_a_timeout(daemon):
    keys, objs = cycled_objects("r40c-slow", N, SIZE, 8, seed=1)
    with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as direct:
        direct.put([(k, objs[i % 8]) for i, k in enumerate(keys)])
    relay = RateLimitedRelay(daemon.endpoint, RATE)
    try:
        with DaemonClient(f"tcp://127.0.0.1:{relay.port}", token=TOKEN, timeout_s=TIMEOUT_S) as client:
            assert client.ping()
            t0 = time.monotonic()
            part = client.get(keys[:N // 8])                # an eighth of the batch: well within the timeout
            eighth_s = time.monotonic() - t0
            assert all(torch.equal(t, objs[i % 8]) for i, t in enumerate(part))
            assert eighth_s < TIMEOUT_S, f"an eighth took {eighth_s:.2f} s; the relay is not the bottleneck?"
            got = client.get(keys)                          # f19ef77: eight replies, each within the timeout
            assert all(torch.equal(t, objs[i % 8]) for i, t in enumerate(got))
    finally:
        relay.close()
