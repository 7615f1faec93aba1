"""A whole local cluster as child processes: store daemon, prefill and decode nodes, proxy.

Used by ``pdserve serve`` (the one-command demo), the benchmark sweeps and the end-to-end tests:

    with LocalCluster(model_dir, ClusterSpec(prefill=1, decode=1)) as cluster:
        cluster.url                         # the proxy, OpenAI-compatible
        cluster.prefill_urls, cluster.decode_urls, cluster.store_url

Start order: store daemon -> nodes (all at once, then wait for each /health) -> proxy (waits for
its /health: >= 1 healthy prefill and decode). The cluster's KV token (``kvstore.auth``: the spec's,
else the environment's PDSERVE_KV_AUTH_TOKEN, else a new random one) reaches the daemon and the nodes
in their environment, never on a command line or in a log; the proxy gets it only with ``kv_routing`` (it then
looks prompts up in the store and verifies the nodes' KV events, ``proxy.kv_routing``). With
``node_api_key`` (``pdserve serve``) the nodes also get a random ``--api-key`` that only the proxy holds
(PDSERVE_API_KEY / PDSERVE_NODE_API_KEY in their environments): a local user cannot drive them directly. Stop order is the reverse; every child is ended
by PID (SIGTERM, then SIGKILL after a grace period). Logs go to one file per child in ``log_dir``.
Inside ``with``, a SIGTERM to this process (``timeout``, a supervisor, a script's clean-up trap) unwinds the
block like Ctrl-C does (``SystemExit(143)`` from the main thread, ``SigtermUnwinds``), so ``__exit__`` ends the
children: a killed benchmark driver used to leave its whole cluster running.
Nodes and the proxy serve on a socket this process bound and passed down (``--fd``): a port picked
free and bound later by the child could be taken in between (see ``pdserve.engine.server.listen``).

Supervision (``supervise()``, called by ``pdserve serve`` twice a second): a child that exited is
started again with the same flags and port, after a back-off that doubles per restart (1 s .. 30 s)
and resets once the child has stayed up for a minute; meanwhile the proxy's health probes route
around it. A node exits non-zero when its engine dies beyond recovery, so this is its restart path.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from pdserve.engine import envs
from pdserve.engine.server.listen import bound_socket
from pdserve.kvstore.auth import new_token

logger = logging.getLogger(__name__)
BACKOFF_BASE_S, BACKOFF_MAX_S, STABLE_S = 1.0, 30.0, 60.0


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    colocated: bool = False                   # one --role both node behind the proxy instead of P/D
    proxy_port: int = 0                       # 0: a free port
    proxy_host: str = "127.0.0.1"             # the proxy's address; everything else binds 127.0.0.1
    api_keys: tuple[str, ...] = field(default=(), repr=False)   # the proxy's --api-key (in its environment)
    node_api_key: bool = False                # the nodes get a random --api-key only the proxy holds (pdserve serve)
    kv_redis: str | None = None               # the daemon's L2 (or, with store="embedded", the shared tier)
    store: str = "daemon"                     # "daemon": one `pdserve kvstore`; "embedded": each node
                                              # embeds a store whose shared tier is --kv-redis
    node_flags: tuple[str, ...] = ()          # passed to every node (e.g. --max-num-batched-tokens 512)
    prefill_flags: tuple[str, ...] = ()       # then to prefill nodes only (e.g. --tensor-parallel-size 2)
    decode_flags: tuple[str, ...] = ()        # then to decode nodes only
    store_flags: tuple[str, ...] = ()         # passed to the store daemon (e.g. --kv-cpu-bytes 8388608)
    proxy_flags: tuple[str, ...] = ()
    expose_kv_accounting: bool = True         # the proxy's --[no-]expose-kv-accounting: a local cluster shows it
    kv_routing: bool = False                  # nodes publish KV events; the proxy holds the KV token and looks
                                              # prompts up in the store (--kv-store): routing by cache
    num_threads: int = 1
    startup_timeout_s: float = 300.0
    kv_auth_token: str = field(default="", repr=False)   # "" : PDSERVE_KV_AUTH_TOKEN, else a new one

    def __post_init__(self) -> None:
        if self.store not in ("daemon", "embedded"):
            raise ValueError(f"store must be 'daemon' or 'embedded', got {self.store!r}")
        if self.store == "embedded" and not self.kv_redis:
            raise ValueError("store='embedded' needs kv_redis: the nodes share KV through Redis")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str = ""
    port: int | None = None                          # set: it serves on a socket bound here (--fd), on this port
    args: list[str] = field(default_factory=list)    # its ``pdserve`` command line, reused on restart
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None                  # when a dead child is due to start again
    secret: bool = False                             # it holds the cluster's KV token (daemon, nodes)


@dataclass
class LocalCluster:
    model_dir: str
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    log_dir: Path | None = None
    children: list[Child] = field(default_factory=list)
    store_url: str = ""
    _sigterm: "SigtermUnwinds | None" = field(default=None, repr=False)
    kv_auth_token: str = field(default="", repr=False)   # set by start(): the token the daemon and nodes hold
    node_api_key: str = field(default="", repr=False)    # set by start() when the spec asks: the nodes' --api-key

    def __enter__(self) -> "LocalCluster":
        self._sigterm = SigtermUnwinds().install()
        try:
            self.start()
        except BaseException:
            self._sigterm.restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._sigterm.restore()

    @property
    def url(self) -> str:
        return self._find("proxy").url

    @property
    def prefill_urls(self) -> list[str]:
        return [c.url for c in self.children if c.name.startswith("prefill") or c.name.startswith("both")]

    @property
    def decode_urls(self) -> list[str]:
        return [c.url for c in self.children if c.name.startswith("decode") or c.name.startswith("both")]

    def start(self) -> None:
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.kv_auth_token = self.spec.kv_auth_token or envs.PDSERVE_KV_AUTH_TOKEN or new_token()
        self.node_api_key = new_token() if self.spec.node_api_key else ""
        proxy_sock = _listen("proxy", self.spec.proxy_port, self.spec.proxy_host)   # first: a taken --port fails early
        try:
            self._start_store()
            self._start_nodes()
            self._start_proxy(proxy_sock)
        except BaseException:
            proxy_sock.close()                                  # no-op once the proxy was spawned
            self.stop()
            raise

    def stop(self) -> None:
        with self._held():                       # a SIGTERM now waits until every child is ended
            for child in reversed(self.children):
                terminate(child.proc)
            self.children.clear()

    def _held(self):
        return self._sigterm.held() if self._sigterm is not None else nullcontext()

    def _start_store(self) -> None:
        if self.spec.colocated or self.spec.store == "embedded":
            return
        # --port 0: the daemon binds a free port itself and names it (READY tcp://...) -- no pick-then-bind race
        flags = ["--port", "0"] + (["--kv-redis", self.spec.kv_redis] if self.spec.kv_redis else [])
        if "--kv-max-object-bytes" not in self.spec.store_flags:      # nothing larger than the model's objects
            flags += ["--kv-max-object-bytes", str(store_object_bytes(self.model_dir, self._all_node_flags()))]
        child = self._spawn("kvstore", ["kvstore", "--host", "127.0.0.1", *flags, *self.spec.store_flags],
                            secret=True)
        self.store_url = _wait_ready_line(child, self.spec.startup_timeout_s)
        child.args[child.args.index("--port") + 1] = self.store_url.rsplit(":", 1)[1]   # a restart keeps the port

    def _start_nodes(self) -> None:
        roles = [("both", 1)] if self.spec.colocated else [("prefill", self.spec.prefill), ("decode", self.spec.decode)]
        started = []
        for role, count in roles:
            for i in range(count):
                store = ["--kv-store", self.store_url] if self.store_url else []
                if self.spec.store == "embedded" and not self.spec.colocated:
                    store = ["--kv-store", "embedded", "--kv-redis", self.spec.kv_redis]
                events = ["--kv-events-port", "0"] if self.spec.kv_routing else []
                child = self._spawn(f"{role}-{i}", ["node", "--model", self.model_dir, "--role", role,
                                                    "--host", "127.0.0.1", *store, *events,
                                                    "--num-threads", str(self.spec.num_threads),
                                                    *self.spec.node_flags, *self._role_flags(role)],
                                    _listen(f"{role}-{i}", 0), secret=True)
                started.append(child)
        for child in started:
            _wait_healthy(child, self.spec.startup_timeout_s)

    def _all_node_flags(self) -> tuple[str, ...]:
        return self.spec.node_flags + self.spec.prefill_flags + self.spec.decode_flags

    def _role_flags(self, role: str) -> tuple[str, ...]:
        return {"prefill": self.spec.prefill_flags, "decode": self.spec.decode_flags}.get(role, ())

    def _start_proxy(self, sock) -> None:
        store = ["--kv-store", self.store_url] if self.spec.kv_routing and self.store_url else []
        if self.spec.kv_routing and self.spec.store == "embedded" and self.spec.kv_redis:   # no daemon: ask Redis
            store = ["--kv-store", self.spec.kv_redis, *_flag_value(self._all_node_flags(), "--kv-redis-prefix")]
        child = self._spawn("proxy", ["proxy", "--model", self.model_dir, "--host", self.spec.proxy_host,
                                      "--prefill", *self.prefill_urls, "--decode", *self.decode_urls, *store,
                                      "--expose-kv-accounting" if self.spec.expose_kv_accounting
                                      else "--no-expose-kv-accounting", *self.spec.proxy_flags], sock,
                            secret=self.spec.kv_routing)
        _wait_healthy(child, self.spec.startup_timeout_s)

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that exited, each after its back-off; returns the names restarted now."""
        now = time.monotonic() if now is None else now
        restarted = []
        for child in self.dead_children():
            if child.restart_at is None:
                up_s = now - child.started_at
                child.restarts = 0 if up_s >= STABLE_S else child.restarts
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** child.restarts)
                child.restart_at = now + delay
                logger.error("%s exited with code %s after %.0fs up; restarting it in %.0fs (log %s)",
                             child.name, child.proc.returncode, up_s, delay, child.log)
            elif now >= child.restart_at:
                try:
                    sock = None if child.port is None else bound_socket("127.0.0.1", child.port)
                except OSError as exc:                # its port was taken meanwhile: try again after a longer back-off
                    child.restarts += 1
                    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** child.restarts)
                    child.restart_at = now + delay
                    logger.error("%s: cannot bind its port %s again (%s); trying again in %.0fs", child.name,
                                 child.port, exc.strerror, delay)
                    continue
                with self._held():                # the new PID is recorded before a SIGTERM acts
                    child.proc = self._popen(child.args, child.log, append=True, sock=sock, secret=child.secret)
                child.started_at, child.restarts, child.restart_at = now, child.restarts + 1, None
                restarted.append(child.name)
        return restarted

    def _spawn(self, name: str, args: list[str], sock: socket.socket | None = None, secret: bool = False) -> Child:
        """Start a child; with ``sock`` it serves on that listening socket (``--fd``) and this process lets go of it;
        ``secret``: it gets the cluster's KV token (in its environment)."""
        log = self.log_dir / f"{name}.log"
        port = None if sock is None else sock.getsockname()[1]
        with self._held():                       # the new PID is recorded before a SIGTERM acts
            child = Child(name, self._popen(args, log, append=False, sock=sock, secret=secret), log, args=list(args),
                          started_at=time.monotonic(), port=port, secret=secret)
            self.children.append(child)
        if port is not None:
            child.url = f"http://127.0.0.1:{port}"
        return child

    def _popen(self, args: list[str], log: Path, append: bool, sock: socket.socket | None,
               secret: bool = False) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.spec.num_threads),
                   PDSERVE_NUM_THREADS=str(self.spec.num_threads), TOKENIZERS_PARALLELISM="false")
        for name in ("PDSERVE_KV_AUTH_TOKEN", "PDSERVE_API_KEY", "PDSERVE_NODE_API_KEY"):
            env.pop(name, None)
        if secret:
            env["PDSERVE_KV_AUTH_TOKEN"] = self.kv_auth_token
        if args[0] == "node" and self.node_api_key:
            env["PDSERVE_API_KEY"] = self.node_api_key
        if args[0] == "proxy":
            env.update({k: v for k, v in (("PDSERVE_API_KEY", " ".join(self.spec.api_keys)),
                                           ("PDSERVE_NODE_API_KEY", self.node_api_key)) if v})
        fds = () if sock is None else (sock.fileno(),)
        try:
            with open(log, "ab" if append else "wb") as out:
                # cwd: not the repo root, whose generic folder names (kernels/) would shadow real packages
                return subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", *args,
                                         *(["--fd", str(fds[0])] if fds else [])], stdout=out,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.log_dir,
                                        pass_fds=fds)
        finally:
            if sock is not None:
                sock.close()                          # the child holds it now; a dead child's port refuses at once

    def _find(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]


def store_object_bytes(model_dir: str, node_flags: tuple[str, ...]) -> int:
    """The largest object the cluster's nodes store: one layer of one chunk (the largest --kv-chunk-tokens
    given, else 256), sealed, in float32 (no --dtype makes it larger). The daemon reads nothing larger back
    from Redis or disk: a value someone else put there costs at most this much per object."""
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.kv.store_factory import object_bytes

    chunks = [int(node_flags[i + 1]) for i, f in enumerate(node_flags[:-1]) if f == "--kv-chunk-tokens"] + \
        [int(f.split("=", 1)[1]) for f in node_flags if f.startswith("--kv-chunk-tokens=")] or [256]
    return object_bytes(ModelConfig.from_dir(model_dir, dtype="float32").kv_layout(), max(chunks))


def _listen(name: str, port: int, host: str = "127.0.0.1") -> socket.socket:
    try:
        return bound_socket(host, port)
    except OSError as exc:
        raise RuntimeError(f"{name}: cannot listen on {host}:{port} ({exc.strerror})") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(child: Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(child)
        try:
            if httpx.get(child.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{child.name} at {child.url} not healthy after {timeout:.0f}s; see {child.log}")


def _wait_ready_line(child: Child, timeout: float) -> str:
    """The endpoint the store daemon printed (``READY tcp://host:port``) once it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(child)
        for line in child.log.read_text(errors="replace").splitlines():
            if line.startswith("READY tcp://"):
                return line.split(None, 1)[1].strip()
        time.sleep(0.1)
    raise TimeoutError(f"{child.name} printed no READY line after {timeout:.0f}s; see {child.log}")


def _check_alive(child: Child) -> None:
    if child.proc.poll() is not None:
        tail = child.log.read_text(errors="replace")[-2000:] if child.log.exists() else ""
        raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}; log {child.log}:\n{tail}")


class SigtermUnwinds:
    """While installed (``install`` .. ``restore``), SIGTERM raises ``SystemExit(128 + SIGTERM)`` in the main
    thread, so ``finally`` blocks and ``__exit__`` run as they do for Ctrl-C. Inside ``held()`` -- a child being
    spawned and not yet recorded, ``LocalCluster.stop`` -- a SIGTERM waits and is raised as the scope ends, so it
    never leaves a PID unrecorded or a stop half done. Once raised, further SIGTERMs are swallowed: the unwinding
    is under way. Installs only from the main thread, over SIGTERM's default action or over another
    ``SigtermUnwinds`` (a cluster inside a cluster: the inner one's, restored to the outer's after; clusters exit
    in reverse order, as ``with`` and ``ExitStack`` do, and a finished one's handler left installed by any other
    order acts as the default action); a handler someone else set (``pdserve serve``'s) is left alone. ``held()``
    acts on the main thread only: SystemExit raised on another would end just that thread."""

    def __init__(self) -> None:
        self._previous = None
        self._state = "off"               # off | armed | held | unwinding
        self._pending = False

    def install(self) -> "SigtermUnwinds":
        if threading.current_thread() is not threading.main_thread():
            return self
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_DFL or isinstance(getattr(current, "__self__", None), SigtermUnwinds):
            self._previous, self._state = current, "armed"      # armed first: a SIGTERM as it installs counts
            signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous, self._state = None, "off"

    @contextmanager
    def held(self) -> Iterator[None]:
        """A SIGTERM inside waits until the scope ends, then raises (if installed and not unwinding already).
        Off the main thread it does nothing: SystemExit raised there would end only that thread."""
        if self._state != "armed" or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._state = "held"
        try:
            yield
        finally:
            if self._state == "held":
                self._state = "armed"
                if self._pending:
                    self._pending = False
                    self._on_sigterm(signal.SIGTERM, None)

    def _on_sigterm(self, signum: int, _frame) -> None:
        if self._state == "held":
            self._pending = True
        elif self._state == "armed":
            self._state = "unwinding"
            raise SystemExit(128 + signum)
        elif self._state == "off":        # left installed by clusters exited out of order: the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; waits, so no zombie is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _flag_value(flags: tuple[str, ...], name: str) -> list[str]:
    """``[name, value]`` as the nodes' flags give it (``name value`` or ``name=value``), [] when absent."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return [name, flags[i + 1]]
        if flag.startswith(name + "="):
            return [flag]
    return []
