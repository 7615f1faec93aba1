"""CURVE on a node's KV-event sockets: a peer without the cluster token cannot complete the ZMQ handshake.

Why: the sockets bind 127.0.0.1, so every local user can connect. The MACs (``kv_events``, ``kv_replay``) keep such
a user from making a message the other side accepts, but not from making ZMQ read one: ZMQ bounds each frame
(``MAXMSGSIZE``), not the number of frames in a message, and hands a message over only whole -- one message of
2M empty frames held the replay thread 19 s and the node 153 MB (``devbench/replay_flood.py``); and a PUB keeps
every subscription its peers send (1M made-up ones: +153 MB). Under CURVE nothing a peer sends gets past ZMQ's I/O
thread until the handshake has succeeded, and it succeeds only for a peer that knows the server's key.

Keys: the server key pair is a function of the cluster token alone -- secret = ``ClusterKey.events_curve_key``
(BLAKE3 derive_key "pdserve kv events curve v1", 32 bytes, z85 for ZMQ), public = curve25519(secret). Every node of
a cluster has the same pair, and the proxy derives the public key the same way; nothing sends or prints it.

Who may connect -- no ZAP handler, on purpose: the client's HELLO is a box sealed to the server's public key, so
only a peer that knows that key gets past it, and here that key is as secret as the token it is derived from (it
is never on the wire: a CurveZMQ client must know it beforehand; the handshake carries short-term keys and, boxed,
the client's own). A ZAP check of the client's key would add a handler thread to the ZMQ context (one per context:
the publisher shares ``zmq.Context.instance()`` with the rest of the node), and protect only against that public
key leaking while the token did not -- a peer that had it would be back where every local user was before (able
to make ZMQ read a large message), and would still fail every MAC of the application, the second layer.
So: **never put the server public key in a card, a log or a metric.** Clients use a fresh key pair of their own.
A node's side is authenticated as well: a squatter on a dead node's port without the token cannot complete the
handshake with the proxy, so it never sees a request (before, the nonce guard alone dealt with a captured one).

Without a token (dev mode) nothing changes: ``server_keys("")`` is None and the sockets stay plain -- as before,
which the CLI never does (a node refuses ``--kv-events-port`` without the token, a proxy without one does not
subscribe). A libzmq without CURVE is an error at start (``require_curve``), not a fallback: the operator gave a
token to close these sockets, a silent fallback would leave them open, and a node and a proxy that disagree
would fail every handshake with nothing logged.

Who calls what: ``KVEventPublisher`` / ``ReplayServer``: ``server_keys(token)`` then ``serve(sock, keys)`` before
``bind``; ``proxy.kv_events.EventSubscriber``: ``server_keys(token)`` then ``connect_to(sock, keys)`` before
``connect``.
"""

from __future__ import annotations

from typing import NamedTuple

import zmq
from zmq.utils import z85


class CurveKeys(NamedTuple):
    public: bytes      # z85, 40 bytes: the server's public key (a secret of the cluster, see above)
    secret: bytes      # z85, 40 bytes


def require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError(f"libzmq {zmq.zmq_version()} (pyzmq {zmq.__version__}) was built without CURVE, which "
                           "the KV events and their replay need when the cluster token is set: install a pyzmq "
                           "wheel (they bundle libzmq with CURVE), or run without --kv-events-port / KV routing")


def server_keys(token: str) -> CurveKeys | None:
    """The cluster's KV-event server key pair; None without a token (dev mode: plain sockets)."""
    if not token:
        return None
    from pdserve.kvstore.auth import ClusterKey

    require_curve()
    secret = z85.encode(ClusterKey(token).events_curve_key)
    return CurveKeys(zmq.curve_public(secret), secret)


def serve(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``sock`` (not yet bound) a CURVE server with ``keys``; plain when None."""
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def connect_to(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of the server with ``keys``, with a key pair of its own."""
    if keys is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
