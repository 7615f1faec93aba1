"""Review 44 (pre-existing, kvstore/session.py): a local process without the cluster token evicts live sessions.

``Hello`` is the one op the daemon serves before authentication, and each Hello from a new zmq identity starts a
session (``Sessions.hello``), evicting the least recently used one past ``MAX_SESSIONS``. So a process that holds
no token, connecting from ``MAX_SESSIONS`` identities (fresh sockets), forgets every real client: each client's next
request is refused (``NO_SESSION``, counted in the daemon's errors) and must Hello again. A flood kept up between a
client's re-Hello and its retry makes the retry fail too (``DaemonError``) -- and ``DaemonClient.discard`` turns
any such DaemonError into a Delete of every copy, intact ones included. A token-less process should be able to do
nothing: a Hello should cost nothing until the client has proved the key (or evict only unproven sessions).
"""

from __future__ import annotations

import contextlib

import zmq

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, serving
from pdserve.kvstore import protocol as P
from pdserve.kvstore import session
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore


def _tokenless_hellos(endpoint: str, n: int) -> None:
    ctx = zmq.Context.instance()
    for i in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            req = P.Hello(nonce=session.new_nonce())
            req.id = 1
            sock.send(P.ENCODER.encode(req))
            assert sock.poll(5000), "the daemon did not answer a Hello"
            sock.recv_multipart()
        finally:
            sock.close(linger=0)


def test_a_tokenless_hello_flood_does_not_evict_a_live_client(monkeypatch):
    monkeypatch.setattr(session, "MAX_SESSIONS", 16)      # (4096 in production: the same flood, 256 times longer)
    with serving(KVDaemon(TieredStore(MemoryTier(1 << 20)), port=0, token=TOKEN)) as daemon, \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=10)) as client:
        assert client.ping()
        errors = daemon._counters["errors"]
        _tokenless_hellos(daemon.endpoint, 17)              # no token: these must be able to do nothing
        assert client.ping()
        assert daemon._counters["errors"] == errors, \
            "a process without the token evicted the client's session: its next request was refused (NO_SESSION)"
