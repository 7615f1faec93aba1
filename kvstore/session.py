"""Mutual authentication between ``DaemonClient`` and the daemon: nothing a listener on the port can reuse.

The wire key (``auth.ClusterKey.wire_key``) never travels. A client first asks whoever answers on the daemon's
port to prove it holds the key, then signs each request for that daemon process only:

    client                                               daemon (its nonce_d: random, one per process)
    Hello(nonce_c)                               ──>     hello'd[ident] = 0  (unproven: its own LRU)
                                                 <──     Reply(nonce=nonce_d, proof=MAC(k, "daemon", nonce_c, nonce_d))
    check proof (else: not the daemon -- nothing more is sent, ``DaemonError``)
    Put/Get/...(id, token=MAC(k, "request", nonce_d, ident, id))  ──>  check MAC, id > last; proven[ident] = id

So a process that takes the port while the daemon is down (a crash, a restart) can neither prove itself nor use
what it receives: each token names the daemon process it was made for (nonce_d), the client's zmq identity and a
request id that only grows (a replay, or a token moved to another connection, is refused). A daemon that lost a
client's session (restarted, or evicted it past ``MAX_SESSIONS``) answers ``code=NO_SESSION``;
Hello needs no key, so the sessions it starts are kept apart until a signed request proves them: a process without
the token can churn only those, never evict a client that has proved the key (review 44). the client says
Hello again and retries once. MACs are BLAKE3 keyed with the wire key; a daemon without a token skips all of it.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from collections import OrderedDict

import blake3

NONCE_BYTES = 16
MAX_SESSIONS = 4096                 # client identities a daemon remembers, proven and unproven apart (a forgotten
#                                     one says Hello again)
_ID = struct.Struct("<Q")


def daemon_proof(wire_key: bytes, nonce_c: bytes, nonce_d: bytes) -> bytes:
    return _mac(wire_key, b"pdserve daemon proof", nonce_c, nonce_d)


def request_token(wire_key: bytes, nonce_d: bytes, ident: bytes, request_id: int) -> str:
    return _mac(wire_key, b"pdserve request", nonce_d, ident, _ID.pack(request_id)).hex()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class SessionError(PermissionError):
    """A request the daemon cannot attribute to a live session (``code``: NO_SESSION) or whose token is wrong."""

    def __init__(self, message: str, no_session: bool = False):
        super().__init__(message)
        self.no_session = no_session


class Sessions:
    """The daemon's side: its nonce and, per client identity, the last request id it accepted."""

    def __init__(self, wire_key: bytes) -> None:
        self.wire_key, self.nonce = wire_key, new_nonce()
        self._hello: OrderedDict[bytes, None] = OrderedDict()    # said Hello, no signed request yet (LRU)
        self._last: OrderedDict[bytes, int] = OrderedDict()      # proved the key: last request id accepted (LRU)

    def hello(self, ident: bytes, nonce_c: bytes) -> bytes:
        """Start (or restart) ``ident``'s session, unproven until its first signed request; -> the proof that this
        daemon holds the key."""
        if not NONCE_BYTES <= len(nonce_c) <= 64:
            raise ValueError(f"hello nonce of {len(nonce_c)} bytes; want {NONCE_BYTES}..64")
        self._last.pop(ident, None)
        _touch(self._hello, ident, None)
        return daemon_proof(self.wire_key, nonce_c, self.nonce)

    def admit(self, ident: bytes, request_id: int, token: str) -> None:
        """Raise ``SessionError`` unless ``token`` signs ``request_id`` for ``ident`` in a live session."""
        last = self._last.get(ident, 0 if ident in self._hello else None)
        if last is None:
            raise SessionError("no session for this client (say hello first)", no_session=True)
        want = request_token(self.wire_key, self.nonce, ident, request_id)
        if not hmac.compare_digest(token.encode(), want.encode()):
            raise PermissionError("bad or missing auth token (--kv-auth-token-file / PDSERVE_KV_AUTH_TOKEN)")
        if request_id <= last:
            raise PermissionError(f"request id {request_id} is not after {last}: a replay")
        self._hello.pop(ident, None)
        _touch(self._last, ident, request_id)


def _touch(table: OrderedDict, ident: bytes, value) -> None:
    """``table[ident] = value`` as its most recent entry; the least recent go past ``MAX_SESSIONS``."""
    table[ident] = value
    table.move_to_end(ident)
    while len(table) > MAX_SESSIONS:
        table.popitem(last=False)


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = blake3.blake3(key=key)
    for part in parts:
        h.update(_ID.pack(len(part)))
        h.update(part)
    return h.digest()
