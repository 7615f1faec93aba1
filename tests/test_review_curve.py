"""Hostile review of CURVE on a node's KV-event sockets (merge 59e32b8): what a local user without the cluster
token can still make the node do, and what the proxy sees when node and proxy disagree on the token.

- A peer with no key at all greets the PUB / replay ROUTER as a CURVE client and sends a 64 MB "HELLO": the node
  must hang up at the frame's size, not buffer it (the PUB had no MAXMSGSIZE).
- A node restarted on its port with another token refuses the proxy's handshake: the proxy must say so (a log line
  and ``kv_events{outcome="refused"}``, once per run of refusals) and read the node again once it is back on the
  cluster's token.

Real processes and sockets: the node's publisher runs in its own process (so its memory is its own), the attacker
is a raw TCP socket speaking just enough ZMTP (the greeting, then one command frame) -- no key of any kind.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

import pytest
import zmq

TOKEN = "c" * 32

# The node: a KV-event publisher (PUB + replay ROUTER, CURVE servers keyed from TOKEN) in its own process; prints
# its endpoints, then waits for stdin to close.
NODE = r"""
import sys
from pdserve.engine.kv.kv_events import KVEventPublisher
pub = KVEventPublisher(sys.argv[1])
print(pub.endpoint, pub.replay_endpoint, flush=True)
sys.stdin.read()
pub.close()
"""
# A ZMTP 3.0 greeting: signature, version 3.0, mechanism CURVE, as-server 0, filler. No key is needed to send it.
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + b"\0" * 31
COMMAND_LONG = 0x06                    # frame flags: a command, 8-byte size
HUGE_HELLO = 64 << 20                  # what the attacker's "HELLO" claims to be (a real one is 200 bytes)


@pytest.fixture
def node():
    proc = subprocess.Popen([sys.executable, "-P", "-c", NODE, TOKEN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        pub, replay = proc.stdout.readline().split()
        yield proc, pub, replay
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _send_huge_hello(endpoint: str) -> int:
    """Greets ``endpoint`` as a CURVE client, then sends one command frame of ``HUGE_HELLO`` bytes; returns how
    many bytes of it went out before the node hung up (all of them: the node took it in)."""
    conn = socket.create_connection(_address(endpoint))
    sent = 0
    try:
        conn.sendall(GREETING + bytes([COMMAND_LONG]) + struct.pack(">Q", HUGE_HELLO))
        chunk = b"\0" * (1 << 20)
        while sent < HUGE_HELLO:
            conn.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        conn.close()
    return sent


@pytest.mark.parametrize("which", ["events PUB", "replay ROUTER"])
def test_a_peer_without_any_key_cannot_make_the_node_buffer_a_huge_handshake_frame(node, which):
    """Before the fix the PUB had no MAXMSGSIZE: ZMQ's I/O thread buffers a handshake command whole before CURVE
    looks at it, so one connection with a 64 MB "HELLO" cost the node 64 MB (two of 200 MB: +400 MB), held until
    the handshake timed out, and a local user can open as many as it likes."""
    proc, pub, replay = node
    before = _rss_mb(proc.pid)
    sent = _send_huge_hello(pub if which == "events PUB" else replay)
    grown = _rss_mb(proc.pid) - before
    assert sent < HUGE_HELLO, f"the node took a {HUGE_HELLO >> 20} MB handshake frame whole (+{grown:.0f} MB)"
    assert grown < 16, f"the node's memory grew {grown:.0f} MB"


def test_a_node_on_another_token_is_reported_and_read_again_once_it_matches(caplog):
    """A node restarted on its fixed events port with another cluster token refuses the proxy's CURVE handshake.
    Before the fix nothing said so: no log line, no counter (before CURVE its batches were counted ``forged`` and
    logged) -- the SUB retried every ~0.1 s in silence. Now the refusal is logged once and counted
    (``kv_events{outcome="refused"}``), and the proxy reads the node again when it is back on the cluster's token."""
    import asyncio
    import logging

    from pdserve.engine.kv.kv_events import KVEventPublisher
    from pdserve.proxy.kv_events import EventSubscriber
    from pdserve.proxy.metrics import ProxyMetrics
    from pdserve.proxy.nodes import Node

    caplog.set_level(logging.INFO, logger="pdserve.proxy.kv_events")
    first = KVEventPublisher(TOKEN)
    port = int(_address(first.endpoint)[1])

    async def until(condition, what):
        deadline = time.monotonic() + 5
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def restart(token):                                      # the old socket unbinds in ZMQ's I/O thread
        deadline = time.monotonic() + 5
        while True:
            try:
                return KVEventPublisher(token, port)
            except zmq.ZMQError:
                assert time.monotonic() < deadline, f"port {port} stays bound"
                await asyncio.sleep(0.02)

    async def main():
        metrics, node = ProxyMetrics(), Node("http://n", "decode")
        refused = metrics.kv_events.labels("refused")._value.get
        sub = EventSubscriber(TOKEN, metrics)
        pubs = [first]
        try:
            sub.watch(node, first.endpoint, first.replay_endpoint)
            await until(lambda: node.kv.epoch == first._epoch, "the proxy reads the node")
            first.close()
            pubs.append(await restart("o" * 32))          # restarted on another token
            sub.watch(node, pubs[-1].endpoint, pubs[-1].replay_endpoint)
            await until(lambda: refused() >= 1, "the refused handshake is counted")
            await asyncio.sleep(0.3)                              # ~3 more refusals: still one line, one count
            lines = [r for r in caplog.records if "refused" in r.getMessage() and "handshake" in r.getMessage()]
            assert len(lines) == 1 and refused() == 1, [r.getMessage() for r in lines]
            pubs[-1].close()
            pubs.append(await restart(TOKEN))             # back on the cluster's token
            sub.watch(node, pubs[-1].endpoint, pubs[-1].replay_endpoint)
            await until(lambda: node.kv.epoch == pubs[-1]._epoch, "the proxy reads the node again")
        finally:
            await sub.stop()
            for pub in pubs[1:]:
                pub.close()

    asyncio.run(main())
