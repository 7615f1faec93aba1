"""The cluster key: who may use the KV store, and the key that seals what it holds.

One secret per cluster (the operator's, or the one ``pdserve serve`` makes). Every process that holds it is
trusted; nothing else is. Keys are derived from it, so none reveals another or the secret:

    cluster token ──BLAKE3 derive_key("pdserve kvstore wire auth v1")──> wire key: daemon and client prove it
                  │                                                       to each other and sign every request
                  │                                                       (``session.py``); it never travels
                  ├─BLAKE3 derive_key("pdserve kv seal v1")────────────> seal key: the keyed MAC of every
                  │                                                       stored object (``seal.py``)
                  └─BLAKE3 derive_key("pdserve kv events curve v1")────> the Curve25519 secret key of a node's
                                                                          KV-event sockets (``engine.kv.kv_curve``)

A daemon checks the signature of every request; a node seals every object it publishes with the seal key and
checks the MAC of every object it loads. Redis, the disk tier and the daemon's memory never see the seal key,
so an object anyone else wrote -- through Redis, a file, or a daemon without a token -- is a counted miss.

Where the token comes from (``resolve_token``, the same for ``pdserve node``, ``kvstore`` and ``serve``), the
first that is set: ``--kv-auth-token-file FILE`` (its first line; the file must not be readable by group or
others), the environment's ``PDSERVE_KV_AUTH_TOKEN`` (how ``pdserve serve`` hands it to its children), then
``--kv-auth-token VALUE`` (shown by ``ps`` to every local user: a warning says so). It is never logged:
``ClusterKey`` prints a short fingerprint only.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import secrets
import stat
from pathlib import Path

import blake3

log = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 16
_WIRE_CONTEXT = "pdserve kvstore wire auth v1"
_SEAL_CONTEXT = "pdserve kv seal v1"
_ID_CONTEXT = "pdserve cluster key id v1"
_EVENTS_CURVE_CONTEXT = "pdserve kv events curve v1"
TOKEN_HELP = ("set PDSERVE_KV_AUTH_TOKEN or --kv-auth-token-file FILE to the cluster's secret (at least "
              f"{MIN_TOKEN_CHARS} characters; `pdserve serve` makes one)")


class ClusterKey:
    """The derived keys of one cluster token. ``wire_key``: 32 bytes that authenticate daemon and clients to each
    other (``session.py``); ``seal_key``: 32 bytes for ``seal.seal``/``unseal``; ``events_curve_key``: 32 bytes,
    the CURVE secret key of the nodes' KV-event sockets (``engine.kv.kv_curve``); ``key_id``: 8 hex characters
    that name the key in logs."""

    __slots__ = ("wire_key", "seal_key", "events_curve_key", "key_id")

    def __init__(self, token: str) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the KV auth token has {len(token)} characters; at least {MIN_TOKEN_CHARS} "
                             "are required (`pdserve serve` makes 64 random hex characters)")
        secret = token.encode()
        self.wire_key = blake3.blake3(secret, derive_key_context=_WIRE_CONTEXT).digest()
        self.seal_key = blake3.blake3(secret, derive_key_context=_SEAL_CONTEXT).digest()
        self.events_curve_key = blake3.blake3(secret, derive_key_context=_EVENTS_CURVE_CONTEXT).digest()
        self.key_id = blake3.blake3(secret, derive_key_context=_ID_CONTEXT).hexdigest()[:8]

    @classmethod
    def random(cls) -> "ClusterKey":
        """A key no other process knows: for a store only this process reads and writes."""
        return cls(new_token())

    def __repr__(self) -> str:
        return f"ClusterKey(id={self.key_id})"


@functools.cache
def process_key() -> ClusterKey:
    """This process's own random key: for stores no other process can reach (an embedded memory store, or
    one store object handed to several engines in one process)."""
    return ClusterKey.random()


def new_token() -> str:
    """A fresh cluster token: 64 hex characters (256 bits)."""
    return secrets.token_hex(32)


def resolve_token(file: str | None, value: str | None, env: str | None, what: str) -> str:
    """The cluster token from (in order) a token file, the environment, a command-line value; "" if none.
    ``what`` names the program in the warning about a token on the command line."""
    if file:
        return read_token_file(Path(file))
    if env:
        return env
    if value:
        log.warning("%s: --kv-auth-token on the command line is visible to every local user (ps, /proc); "
                    "prefer PDSERVE_KV_AUTH_TOKEN or --kv-auth-token-file", what)
        return value
    return ""


def read_token_file(path: Path) -> str:
    """The first line of ``path``; refused when group or others may read or write it (like ssh's keys)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        mode = os.fstat(fd).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"--kv-auth-token-file {path} has mode {stat.filemode(mode)}; make it readable "
                                  f"by its owner only (chmod 600 {path})")
        with os.fdopen(os.dup(fd), "r") as f:
            token = f.readline().strip()
    finally:
        os.close(fd)
    if not token:
        raise ValueError(f"--kv-auth-token-file {path} is empty")
    return token


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster token's flags, the same on ``pdserve kvstore``, ``node`` and ``serve`` (``auth.py``)."""
    p.add_argument("--kv-auth-token-file", default=None,
                   help="file holding the cluster's secret (mode 600); or set PDSERVE_KV_AUTH_TOKEN")
    p.add_argument("--kv-auth-token", "--auth-token", dest="kv_auth_token", default="",
                   help="the cluster's secret on the command line (visible to local users: prefer the file or "
                        "PDSERVE_KV_AUTH_TOKEN)")


def token_from_args(args: argparse.Namespace, what: str) -> str:
    from pdserve.engine import envs

    return resolve_token(args.kv_auth_token_file, args.kv_auth_token, envs.PDSERVE_KV_AUTH_TOKEN, what)


def check_exposure(token: str, host: str, allow_unauthenticated: bool) -> None:
    """The daemon's bind check: without a token, loopback only (unless allowed), and a loud warning."""
    if token:
        return
    if not _is_loopback(host) and not allow_unauthenticated:
        raise ValueError(f"binding {host} (not loopback) without a token would let anyone who reaches it read and "
                         f"write the cluster's KV: {TOKEN_HELP} (or pass --allow-unauthenticated)")
    log.warning("KV store daemon WITHOUT an auth token on %s: every local user (and anyone who reaches %s) can "
                "read, write, delete and attach shared memory; %s", host, host, TOKEN_HELP)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
