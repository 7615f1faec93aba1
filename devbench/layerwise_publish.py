"""A prefill node's response time with the KV published layer by layer against per step, on a store with real puts.

    python devbench/layerwise_publish.py [--model tiny|smollm2-135m-instruct|DIR] [--prompt-len 1536]
                                         [--store redis,daemon] [--repeats 5] [--output out.json]

One process, one torch thread, fixed-seed random prompts (a new one per request: no store or prefix hit). Three
in-process ``LLMEngine``s on the same weights, the same store kind:
  compute     role both, no store: the prefill compute alone (the baseline)
  per-step    role prefill, --no-kv-publish-layerwise: chunks gathered and put after the whole forward
  layerwise   role prefill, --kv-publish-layerwise: each layer put while later layers compute
A request is a prefill node's request (max_tokens 1, do_remote_decode): its response waits for the publish, so
its time = compute + the publish tail. Stores: ``redis`` = the embedded store over a private redis-server (the
prefill node flushes every chunk to Redis before it counts: real put latency), ``daemon`` = a ``pdserve kvstore``
daemon over TCP (zmq frames, no shared memory). The three alternate in each repeat. Per request it times the
response and the step that computed the prompt (its gathers included); tail = response - step is the publish time
the response waited for after the forward, the figure layerwise shrinks, and the least sensitive to a noisy CPU.
Medians and the ratios layerwise / per-step are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

TOKEN = "devbench-layerwise-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The redis-server / daemon this run started, each ended by its pid."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def redis(self) -> str:
        port = _free_port()
        self.procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                            "--appendonly", "no"], stdout=subprocess.DEVNULL))
        import redis

        client, deadline = redis.Redis(port=port), time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
                return f"redis://127.0.0.1:{port}/0"
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def daemon(self) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_KV_AUTH_TOKEN": TOKEN}
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--kv-cpu-bytes",
                                 str(512 << 20), "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, env=env)
        self.procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"daemon did not start: {line!r}")
        return line.split()[1]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _engine(model_dir: str, store: dict | None, layerwise: bool):
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine

    kv = KVTransferConfig() if store is None else \
        KVTransferConfig(role="prefill", kv_auth_token=TOKEN, kv_publish_layerwise=layerwise, kv_cpu_bytes=512 << 20,
                         **store)
    max_len = min(4096, json.load(open(os.path.join(model_dir, "config.json")))["max_position_embeddings"])
    cfg = EngineConfig(model=model_dir, cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=max_len, max_model_len=max_len), kv_transfer=kv)
    return LLMEngine(cfg)


def _response_s(engine, rid: str, prompt: list[int], store: bool) -> tuple[float, float]:
    """(seconds from add_request to the request's final output -- a prefill node's: after its publish --, seconds
    until the step that computed the prompt returned). The prompt fits one step."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, {"do_remote_decode": True} if store else None)
    done, computed = any(out.finished for out in engine.step()), time.perf_counter() - start
    while not done:
        done = any(out.finished for out in engine.step())
    return time.perf_counter() - start, computed


def measure(model_dir: str, store: dict, prompt_len: int, repeats: int, vocab: int, one_engine: bool) -> dict:
    if one_engine:                  # a box short of memory: one prefill engine, its connector switched per request
        prefill = _engine(model_dir, store, True)
        engines = {"per-step": prefill, "layerwise": prefill}
    else:
        engines = {"compute": _engine(model_dir, None, False), "per-step": _engine(model_dir, store, False),
                   "layerwise": _engine(model_dir, store, True)}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for r in range(repeats + 1):                                 # repeat 0 warms up, not counted
            names = list(engines) if r % 2 else list(engines)[::-1]
            for name in names:
                prompt = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
                engines[name].connector is None or setattr(engines[name].connector, "layerwise", name == "layerwise")
                response, step = _response_s(engines[name], f"{name}-{r}", prompt, name != "compute")
                if r:
                    times[name].append(response)
                    steps[name].append(step)
    finally:
        for e in set(engines.values()):
            e.shutdown()
    med = {name: statistics.median(v) for name, v in times.items()}
    step = {name: statistics.median(v) for name, v in steps.items()}
    tail = {name: statistics.median([a - b for a, b in zip(times[name], steps[name])]) for name in engines}
    return {"median_s": med, "step_s": step, "tail_s": tail, "all_s": times, "all_step_s": steps,
            "ratio_response": med["layerwise"] / med["per-step"], "ratio_step": step["layerwise"] / step["per-step"],
            "ratio_tail": tail["layerwise"] / tail["per-step"] if tail["per-step"] > 0 else None}


def _model(name: str, layers: int) -> str:
    if name == "tiny":
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model

        return str(make_tiny_model(tempfile.mkdtemp(prefix="lw-tiny-"), arch="llama", seed=0, num_layers=layers))
    from pdserve.engine.node import resolve_model

    return str(resolve_model(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tiny-layers", type=int, default=2, help="layers of the generated tiny model")
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--store", default="redis,daemon")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default=None)
    ap.add_argument("--one-engine", action="store_true",
                    help="less memory: no compute-only engine; one prefill engine switched between the two ways")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = _model(a.model, a.tiny_layers)
    config = json.load(open(os.path.join(model_dir, "config.json")))
    procs, results = Processes(), {}
    try:
        for kind in a.store.split(","):
            store = {"kv_store": "embedded", "kv_redis": procs.redis()} if kind == "redis" else \
                {"kv_store": procs.daemon(), "kv_shm_bytes": 0}
            results[kind] = measure(model_dir, store, a.prompt_len, a.repeats, config["vocab_size"], a.one_engine)
    finally:
        procs.stop()
    print(f"{a.model} ({config['num_hidden_layers']} layers), {a.prompt_len}-token prompt, {a.repeats} repeats, "
          f"medians; {platform.processor() or platform.machine()}, {a.threads} torch thread(s), torch {torch.__version__}")
    print("response = add_request -> final output; step = until the prompt's step returned; tail = response - step "
          "(per request); ms, medians")
    print(f"{'store':7} {'engine':10} {'response':>9} {'step':>9} {'tail':>8}")
    for kind, r in results.items():
        for name in r["median_s"]:
            print(f"{kind:7} {name:10} {r['median_s'][name] * 1e3:9.1f} {r['step_s'][name] * 1e3:9.1f} "
                  f"{r['tail_s'][name] * 1e3:8.1f}")
        ratio_tail = f"{r['ratio_tail']:.2f}" if r["ratio_tail"] is not None else "-"
        print(f"{kind:7} layerwise / per-step: response {r['ratio_response']:.2f}, step {r['ratio_step']:.2f}, "
              f"tail {ratio_tail}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"model": a.model, "prompt_len": a.prompt_len, "repeats": a.repeats, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
