"""KV store concurrency stress: several prefill and decode engines share one store daemon.

Who calls it: tests/test_kv_stress.py (a CI-sized run) and, for the long variant, this file:

    python devbench/kv_stress.py --model DIR --requests 1000 [--stop-daemon 3] [--json out.json]

Every engine runs on its own thread with its own publisher and loader threads. The stores: one engine
of each role talks to the daemon over shared memory, one over TCP, and one prefill and one decode
engine share a single ``DaemonClient`` -- so loads and publishes overlap on one client, one segment,
one daemon. Prompts share prefixes (store hits, chunks published twice) or are fresh; every
``abort_every``-th request is aborted on the prefill or the decode side; with ``stop_daemon`` the
daemon is SIGSTOPped longer than the clients' timeout that many times (timeouts, late replies).

The invariant: every greedy answer that was not aborted equals the colocated reference, token for
token, and no object ever fails its seal. The report counts requests, loads, publishes and mismatches.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.auth import new_token
from pdserve.kvstore.client import DaemonClient

BATCH = 4                  # requests an engine thread takes at once
KV_BYTES = 32 << 20        # per engine: seven engines at the default 512 MiB would hold 3.5 GiB


@dataclass
class StressConfig:
    model: str
    daemon_url: str
    daemon_pid: int | None = None       # needed for stop_daemon
    requests: int = 48
    max_tokens: int = 6
    abort_every: int = 7
    stop_daemon: int = 0                # how many SIGSTOP/SIGCONT pauses
    stop_s: float = 1.2                 # each pause; > client_timeout_s
    client_timeout_s: float = 0.5
    chunk_tokens: int = 32
    block_size: int = 8
    seed: int = 0
    token: str = field(default="", repr=False)   # the cluster token the daemon was started with ("" : none)


@dataclass
class StressReport:
    requests: int = 0
    compared: int = 0
    mismatches: int = 0
    aborted: int = 0
    failed: int = 0                     # finished with an error (not an abort we asked for)
    loads: int = 0                      # decode requests that loaded KV from the store
    loaded_tokens: int = 0
    published_chunks: int = 0
    integrity_failures: int = 0
    digest_mismatches: int = 0
    load_failures: int = 0
    publish_failures: int = 0
    daemon_pauses: int = 0
    seconds: float = 0.0
    mismatch_ids: list[str] = field(default_factory=list)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    abort: str = ""                     # "", "prefill" or "decode"
    params: dict | None = None


def make_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """2/3 share one of four 64-token prefixes (some repeat whole), 1/3 fresh; 40-150 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(4)]
    prompts: list[list[int]] = []
    for i in range(n):
        if i % 3 == 2:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randrange(40, 150))])
        elif i % 5 == 4 and prompts:
            prompts.append(list(prompts[rng.randrange(len(prompts))]))
        else:
            prompts.append(rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 80))])
    return prompts


def reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Colocated greedy output of every prompt (one engine, no store)."""
    engine = LLMEngine(EngineConfig(model=model, cache=CacheConfig(block_size=8, kv_cache_memory_bytes=KV_BYTES)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def _engine(cfg: StressConfig, role: str, store) -> LLMEngine:
    ec = EngineConfig(model=cfg.model, cache=CacheConfig(block_size=cfg.block_size, kv_cache_memory_bytes=KV_BYTES),
                      scheduler=SchedulerConfig(max_num_batched_tokens=256),
                      kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=cfg.chunk_tokens,
                                                   kv_auth_token=cfg.token))   # seals keyed with it
    return LLMEngine(ec, store=store)


def _drain(q: queue.Queue, first) -> list:
    items = [first]
    while len(items) < BATCH:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is None:
            q.put(None)
            break
        items.append(item)
    return items


def _run_batch(engine: LLMEngine, reqs: list[_Req], side: str, max_tokens: int) -> dict[str, tuple[list, object]]:
    """Run ``reqs`` together on ``engine``; abort those marked for this side after the first step."""
    params = SamplingParams(max_tokens=1 if side == "prefill" else max_tokens, temperature=0.0, ignore_eos=True)
    for r in reqs:
        engine.add_request(r.rid, r.prompt, params, {"do_remote_decode": True} if side == "prefill" else r.params)
    out: dict[str, tuple[list, object]] = {r.rid: ([], None) for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            tokens, _ = out[delta.request_id]
            out[delta.request_id] = (tokens + delta.new_token_ids, delta if delta.finished else None)
        steps += 1
        if steps == (1 if side == "prefill" else 2):     # prefill: while its chunks are being published
            for r in reqs:
                if r.abort == side:
                    engine.abort_request(r.rid)
    return out


class _Stress:
    def __init__(self, cfg: StressConfig, prompts: list[list[int]], expected: list[list[int]]):
        self.cfg, self.expected = cfg, expected
        self.report = StressReport(requests=len(prompts))
        self.lock = threading.Lock()
        self.todo: queue.Queue = queue.Queue()
        self.to_decode: queue.Queue = queue.Queue()
        self.done = 0
        self.reqs = []
        for i, p in enumerate(prompts):
            abort = "" if (i + 1) % cfg.abort_every else ("prefill", "decode")[(i // cfg.abort_every) % 2]
            self.reqs.append(_Req(str(i), p, abort))

    def prefill_loop(self, engine: LLMEngine) -> None:
        while (first := self.todo.get()) is not None:
            reqs = _drain(self.todo, first)
            results = _run_batch(engine, reqs, "prefill", self.cfg.max_tokens)
            for r in reqs:
                tokens, final = results[r.rid]
                if final is None or final.error or not final.kv_transfer_params:
                    self._count(aborted=int(r.abort == "prefill"), failed=int(r.abort != "prefill"))
                    continue
                r.params = final.kv_transfer_params
                self.to_decode.put(r)
        self.todo.put(None)

    def decode_loop(self, engine: LLMEngine) -> None:
        while (first := self.to_decode.get()) is not None:
            reqs = _drain(self.to_decode, first)
            results = _run_batch(engine, reqs, "decode", self.cfg.max_tokens)
            for r in reqs:
                self._check(r, *results[r.rid])
        self.to_decode.put(None)

    def _check(self, r: _Req, tokens: list[int], final) -> None:
        if final is None or final.error:
            self._count(aborted=int(r.abort == "decode"), failed=int(r.abort != "decode"))
            return
        loaded = final.kv_accounting["loaded_tokens"] if final.kv_accounting else 0
        ok = tokens == self.expected[int(r.rid)]
        with self.lock:
            self.report.compared += 1
            self.report.loads += int(loaded > 0)
            self.report.loaded_tokens += loaded
            if not ok:
                self.report.mismatches += 1
                self.report.mismatch_ids.append(r.rid)
            self.done += 1

    def _count(self, **deltas: int) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self.report, k, getattr(self.report, k) + v)
            self.done += 1

    def feed(self) -> None:
        """Feed the requests in ``stop_daemon + 1`` waves; SIGSTOP the daemon past the clients' timeout
        once half of a wave is done, while the rest of it is in flight, and only then feed the next."""
        waves = self.cfg.stop_daemon + 1
        fed = 0
        for w in range(waves):
            wave = self.reqs[len(self.reqs) * w // waves:len(self.reqs) * (w + 1) // waves]
            for r in wave:
                self.todo.put(r)
            fed += len(wave)
            if w < self.cfg.stop_daemon:
                while self.done < fed - len(wave) // 2:
                    time.sleep(0.005)
                self._pause()
        self.todo.put(None)

    def _pause(self) -> None:
        os.kill(self.cfg.daemon_pid, signal.SIGSTOP)
        try:
            time.sleep(self.cfg.stop_s)
        finally:
            os.kill(self.cfg.daemon_pid, signal.SIGCONT)
        self.report.daemon_pauses += 1


def run_stress(cfg: StressConfig, progress: bool = False) -> StressReport:
    from pdserve.engine.models.model_config import ModelConfig

    vocab = ModelConfig.from_dir(cfg.model).vocab_size
    prompts = make_prompts(vocab, cfg.requests, cfg.seed)
    expected = reference(cfg.model, prompts, cfg.max_tokens)
    shm, tcp = _client(cfg, 16 << 20), _client(cfg, 0)
    shared = _client(cfg, 16 << 20)
    engines = {"prefill": [_engine(cfg, "prefill", s) for s in (shm, tcp, shared)],
               "decode": [_engine(cfg, "decode", s) for s in (_client(cfg, 16 << 20), _client(cfg, 0), shared)]}
    stress = _Stress(cfg, prompts, expected)
    t0 = time.monotonic()
    threads = [threading.Thread(target=stress.prefill_loop, args=(e,)) for e in engines["prefill"]]
    threads += [threading.Thread(target=stress.decode_loop, args=(e,)) for e in engines["decode"]]
    feeder = threading.Thread(target=stress.feed, name="kv-stress-feed")
    for t in threads + [feeder]:
        t.start()
    feeder.join()
    _join_prefill_then_decode(threads, len(engines["prefill"]), stress, progress)
    stress.report.seconds = time.monotonic() - t0
    _collect(stress.report, engines)
    return stress.report


def _client(cfg: StressConfig, shm_bytes: int) -> DaemonClient:
    return DaemonClient(cfg.daemon_url, token=cfg.token, shm_bytes=shm_bytes, timeout_s=cfg.client_timeout_s)


def _join_prefill_then_decode(threads, num_prefill: int, stress: _Stress, progress: bool) -> None:
    for t in threads[:num_prefill]:
        t.join()
    stress.to_decode.put(None)
    while any(t.is_alive() for t in threads[num_prefill:]):
        threads[-1].join(timeout=5)
        if progress:
            print(f"  {stress.done}/{stress.report.requests} requests done", file=sys.stderr)
    for t in threads:
        t.join()


def _collect(report: StressReport, engines: dict) -> None:
    stores = set()
    for role, group in engines.items():
        for e in group:
            c = e.connector
            c.shutdown()
            report.integrity_failures += c.loader.integrity_failures
            report.digest_mismatches += c.loader.digest_mismatches
            report.load_failures += c.loader.failures
            report.publish_failures += c.publisher.failures
            report.published_chunks += c.publisher.published
            stores.add(e.store)
    for s in stores:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--stop-daemon", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    token = new_token()                  # auth and keyed seals on, as `pdserve serve` runs them
    daemon = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--log-level", "WARNING"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PDSERVE_KV_AUTH_TOKEN": token})
    try:
        line = daemon.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"daemon did not start: {line!r}")
        cfg = StressConfig(model=args.model, daemon_url=line.split()[1], daemon_pid=daemon.pid,
                           requests=args.requests, stop_daemon=args.stop_daemon, seed=args.seed, token=token)
        report = run_stress(cfg, progress=True)
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
    print(json.dumps(asdict(report), indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.mismatches == 0 and report.integrity_failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
