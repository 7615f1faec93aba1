"""The link between a node's API process and its engine core is private (issue 35, item 6).

A local user found the core's abstract-namespace sockets in /proc/net/unix, and as uid nobody read other
requests' outputs, ran requests of its own, stopped the node with ``Shutdown`` and killed the core with nine
bytes of garbage. Here, against a real node (``--engine-core-process``): another user can connect to none of
the node's unix sockets, nor list their 0700 directory while it exists; a second connection of the node's
own user (after start: nothing left to connect to; during start-up, first: ignored) steals no output, runs
nothing and stops nothing; garbage on the link, either way, is dropped and the next request is answered right.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from channel_probes import GARBAGE, Intruder, as_nobody, try_connect, try_list, unix_names
from conftest import NodeProcess
from hf_reference import hf_greedy, hf_model
from polling import wait_until
from pdserve.engine.core import messages as m
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.text.tokenizer import load_tokenizer

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Every student never forgot three green apples",
           "Her younger brother bravely crossed the winter garden"]
TOKENS = 30
INJECTED = m.AddRequest("intruder", 1, list(range(5, 25)), SamplingParams(max_tokens=2000, ignore_eos=True))


def _complete(url: str, prompt: str) -> tuple:
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    if r.status_code != 200:
        return r.status_code, r.text
    choice = r.json()["choices"][0]
    return r.status_code, choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]


def _core_pid(node: NodeProcess) -> int:
    [core] = [int(c) for task in Path(f"/proc/{node.proc.pid}/task").iterdir()
              for c in (task / "children").read_text().split()]
    return core


@pytest.fixture(scope="module")
def core_node(tiny_llama):
    node = NodeProcess(tiny_llama, "--engine-core-process")
    yield node
    node.stop()


def test_another_user_can_connect_to_none_of_the_nodes_unix_sockets(core_node):
    names = unix_names([core_node.proc.pid, _core_pid(core_node)])
    assert names, "the node's processes hold no named unix socket"
    seen = as_nobody(lambda: {name: try_connect(name) for name in names})
    assert "connected" not in seen.values(), seen


def test_a_second_connection_steals_nothing_runs_nothing_stops_nothing(core_node):
    url = core_node.url
    before = [_complete(url, p) for p in PROMPTS]
    assert all(b[2:] == ("length", TOKENS) for b in before), before
    names = unix_names([core_node.proc.pid, _core_pid(core_node)])
    intruder = Intruder(names)                # PULL / DEALER would read outputs, PUSH / DEALER inject
    try:
        intruder.send(GARBAGE + [m.encode(INJECTED)])
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            during = list(pool.map(lambda p: _complete(url, p), PROMPTS))
        intruder.send([m.encode(m.Shutdown("intruder"))])
        after = _complete(url, PROMPTS[0])
        stolen = intruder.received(200)
    finally:
        intruder.close()
    assert during == before and after == before[0]
    assert stolen == []
    assert core_node.proc.poll() is None and httpx.get(url + "/health", timeout=5).status_code == 200
    assert {name: try_connect(name) for name in names} == {name: "ENOENT" for name in names}   # all gone


def test_an_intruder_connected_first_during_start_up_is_ignored(tiny_llama, monkeypatch):
    base = tempfile.mkdtemp(prefix="cc-", dir="/tmp")      # short, and others may enter it: only the node's
    os.chmod(base, 0o755)                                  # own directory inside keeps them out
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("PDSERVE_FAULTS", "slow_core_connect=3")      # the core connects after the intruder
    tok = load_tokenizer(tiny_llama)
    expected = tok.decode(hf_greedy(hf_model(tiny_llama), tok.encode(PROMPTS[1]), TOKENS), skip_special_tokens=True)
    pool = ThreadPoolExecutor(1)
    job = pool.submit(NodeProcess, tiny_llama, "--engine-core-process")
    try:
        sock_dir = wait_until(lambda: _socket_dir(base), 120, "the node's socket directory with both sockets")
        mode = os.stat(sock_dir)
        assert (stat.S_IMODE(mode.st_mode), mode.st_uid) == (0o700, os.getuid())
        seen = as_nobody(lambda: [try_list(sock_dir)] + [try_connect(f"{sock_dir}/{n}") for n in ("up", "down")])
        assert seen == ["EACCES"] * 3
        intruder = Intruder([f"{sock_dir}/up", f"{sock_dir}/down"])
        forged = [m.encode(m.Hello(b"\0" * 32)), m.encode(m.Fatal("intruder")), m.encode(INJECTED),
                  m.encode(m.Shutdown("intruder"))]
        intruder.send(GARBAGE + forged)
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(f"{sock_dir}/up")
        raw.sendall(b"\x01garbage" * 50)
        node = job.result()
        try:
            answer = _complete(node.url, PROMPTS[1])
            stolen = intruder.received(200)
            intruder.close()
            raw.close()
            assert not os.path.exists(sock_dir)        # gone once the core was connected
            assert node.proc.poll() is None
        finally:
            log = node.stop()
    finally:
        pool.shutdown(wait=True)
        if job.exception() is None and job.result().proc.poll() is None:
            job.result().stop()
        os.rmdir(base)
    assert answer == (200, expected, "length", TOKENS)
    assert stolen == []
    assert "dropped a frame" in log, log[-3000:]


def _socket_dir(base: str) -> str | None:
    for entry in Path(base).glob("pdserve-core-*"):
        if (entry / "up").exists() and (entry / "down").exists():
            return str(entry)
    return None


def test_garbage_on_the_link_to_the_core_is_dropped(tiny_llama, capfd):
    """The API process's own link, garbage in it (a bug, another build): the core drops it and carries on."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), engine_core_process=True))
    client = engine.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    wrong_kind, other_version = m.encode(m.Heartbeat()), m.encode(m.Shutdown("x", version=m.VERSION + 1))
    try:
        expected = _generate(engine, [5, 6, 7, 8], params, "before")
        for data in GARBAGE + [wrong_kind, other_version]:
            _send_raw(client, data)
        got = _generate(engine, [5, 6, 7, 8], params, "after")
        assert got == expected and len(got) == 8
        assert engine.is_healthy() and client.proc.poll() is None
    finally:
        engine.shutdown()
    assert "engine core: dropped a frame" in capfd.readouterr().err


def _send_raw(client, data: bytes) -> None:
    with client._lock:
        if hasattr(client, "_channel"):
            client._channel.send(data)
        else:                                  # the code before the private channel (the test must fail there)
            client._to_core.send(data)


def _generate(engine, prompt: list[int], params, request_id: str) -> list[int]:
    async def run() -> list[int]:
        tokens = []
        async for out in engine.generate(prompt, params, request_id):
            tokens += out.new_token_ids
        return tokens

    return asyncio.run(asyncio.wait_for(run(), 120))


def test_the_api_end_takes_only_the_connection_that_proved_the_token():
    """``ApiChannel`` with real sockets: an intruder connected first sends garbage, a wrong Hello and a forged
    Fatal on both sockets; then the core's end connects. Only the core's messages come out (an undecodable one
    of its own is dropped); only it is answered."""
    import zmq

    from pdserve.engine.core import channel

    ch, ctx = channel.ApiChannel(), zmq.Context()
    sock_dir = ch.dir
    try:
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
        start = ch.start_message(None)
        intruder = {name: ctx.socket(zmq.DEALER) for name in ("down", "up")}
        frames = GARBAGE + [m.encode(m.Hello(b"\0" * channel.TOKEN_BYTES)), m.encode(m.Fatal("intruder"))]
        for name, sock in intruder.items():
            sock.connect(getattr(start, f"{name}_address"))
            for frame in frames:
                sock.send(frame)
        wait_until(lambda: ch.poll_start(50) is None and ch.drops.count == 2 * len(frames), 30, "intruder dropped")
        down, up = channel.connect(ctx, start)                 # the core's end: Hello(token) on each
        for frame in (b"\x01garbage", m.encode(m.Heartbeat())):
            up.send(frame)
        intruder["up"].send(m.encode(m.Fatal("intruder")))
        got = []
        wait_until(lambda: got.append(ch.poll_start(50)) or (ch.ready and m.Heartbeat() in got), 30, "the core's")
        assert [msg for msg in got if msg is not None] == [m.Heartbeat()]
        assert not os.path.exists(sock_dir)                    # both Hellos came: no one can connect any more
        ch.send(b"for the core")
        assert down.poll(5000) and down.recv() == b"for the core"
        assert intruder["down"].poll(200) == 0 and intruder["up"].poll(0) == 0
    finally:
        ch.close()
        ctx.destroy(linger=0)


def test_the_socket_directory_is_under_a_runtime_dir_only_when_ours_and_short(tmp_path, monkeypatch):
    from pdserve.engine import private_dir

    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))

    def parent() -> Path:
        made = private_dir.make("pdserve-core-", socket_names=("down", "up"))
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
        private_dir.remove(made)
        assert not os.path.exists(made)
        return Path(made).parent

    assert parent() == runtime
    os.chmod(runtime, 0o777)                      # others may write it: not used
    assert parent() == Path(tempfile.gettempdir())
    os.chmod(runtime, 0o700)
    os.chown(runtime, 65534, 65534)               # someone else's
    assert parent() == Path(tempfile.gettempdir())
    deep = tmp_path / ("x" * 100)                 # a socket path under it would pass sun_path's 107 bytes
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    assert parent() == Path(tempfile.gettempdir())
