"""Proxy overhead: the two P->D hops by hand against the same request through the proxy, in one run.

    python devbench/proxy_overhead.py [--model DIR] [--requests 200] [--prompt-tokens 64] [--max-tokens 2]
                                   [--hand-prompt text|ids] [--output out.json]
                                   [--prefill-url URL --decode-url URL --proxy-url URL]

Without URLs it starts a local cluster (``LocalCluster``: store daemon, one prefill node, one decode node,
the proxy) on ``--model``, or on a generated tiny model (``pdserve make-tiny-model``, seed 0). Then, one
request at a time, each round i runs four requests in a shuffled order (fixed seed), each with a fresh
prompt of exactly ``--prompt-tokens`` tokens, so no request finds another's prefix in a node's cache:

    hand  json    POST prefill /v1/completions {prompt, max_tokens 1, kv_transfer_params {do_remote_decode}}
                  POST decode  /v1/completions {prompt, max_tokens N, kv_transfer_params <prefill's answer>}
    hand  stream  the same, the decode call with stream: true, read to data: [DONE]
    proxy json    POST proxy   /v1/completions {prompt, max_tokens N}
    proxy stream  the same with stream: true, read to data: [DONE]

A latency is first byte sent to last byte read, on a kept-alive ``http.client`` connection per server (the
lightest client: the hand path pays the client twice, the proxy path once). By hand the prompt goes as text
(each node tokenizes it, as a client would); the proxy tokenizes once and sends the ids on, so the nodes do
not. ``--hand-prompt ids`` sends the hand path the ids instead: then nobody tokenizes on that path and the
proxy's own tokenizing counts in full in its added latency. The proxy's added latency is
proxy p50 - hand p50 (and p99), per mode and over both, beside the median of the per-round differences.
Every answer is checked (HTTP 200, a completion, a stream that ends in [DONE] without an error event).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

PATHS, MODES = ("hand", "proxy"), ("json", "stream")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
WORDS = ("the fox dog river bank dawn walk talk light stone tree wind cloud road house sea green "
         "quick slow bright dark over under near far city field hill lake").split()


class Conn:
    """One kept-alive HTTP/1.1 connection to one server; reopened after an error."""

    def __init__(self, base_url: str):
        url = urlsplit(base_url)
        self.host, self.port, self._conn = url.hostname, url.port, None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        return self.request("POST", path, json.dumps(body).encode())

    def request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        for attempt in range(2):             # a kept-alive connection the server closed: once more on a new one
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                self._conn.request(method, path, data, {"Content-Type": "application/json"})
                response = self._conn.getresponse()
                return response.status, response.read()
            except (http.client.RemoteDisconnected, ConnectionError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Target:
    """Where the requests go: a prefill node, a decode node and the proxy in front of both."""

    def __init__(self, prefill_url: str, decode_url: str, proxy_url: str, model: str):
        self.prefill, self.decode, self.proxy = Conn(prefill_url), Conn(decode_url), Conn(proxy_url)
        self.model = model
        self.hand_ids: dict[str, list[int]] = {}     # --hand-prompt ids: what the hand path sends instead of text

    def hand_prompt(self, prompt: str) -> str | list[int]:
        return self.hand_ids.get(prompt, prompt)

    def close(self) -> None:
        for conn in (self.prefill, self.decode, self.proxy):
            conn.close()


def make_prompts(tokenizer, count: int, num_tokens: int, seed: int) -> list[str]:
    """``count`` distinct random-word prompts of exactly ``num_tokens`` tokens (the node's encoding)."""
    rng, prompts = random.Random(seed), []
    while len(prompts) < count:
        text = _prompt(tokenizer, rng, num_tokens)
        if text is not None and text not in prompts:
            prompts.append(text)
    return prompts


def _prompt(tokenizer, rng: random.Random, num_tokens: int) -> str | None:
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < num_tokens:
        words.append(rng.choice(WORDS))
    text = " ".join(words)
    while len(tokenizer.encode(text)) > num_tokens and text:
        text = text[:-1]                                  # a word cut short: one token fewer, or none
    return text if len(tokenizer.encode(text)) == num_tokens else None


def by_hand(target: Target, text: str, max_tokens: int, stream: bool) -> float:
    prompt = target.hand_prompt(text)
    start = time.perf_counter()
    first = _checked_json(*target.prefill.post("/v1/completions", {
        "model": target.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
        "kv_transfer_params": PREFILL_PARAMS}), "prefill")
    kv = first.get("kv_transfer_params")
    if not kv:
        raise RuntimeError("the prefill node returned no kv_transfer_params; is it a --role prefill node?")
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "kv_transfer_params": kv}
    _check_answer(*target.decode.post("/v1/completions", body), stream, "decode")
    return time.perf_counter() - start


def through_proxy(target: Target, prompt: str, max_tokens: int, stream: bool) -> float:
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    start = time.perf_counter()
    _check_answer(*target.proxy.post("/v1/completions", body), stream, "proxy")
    return time.perf_counter() - start


def _checked_json(status: int, content: bytes, who: str) -> dict[str, Any]:
    if status != 200:
        raise RuntimeError(f"{who} answered {status}: {content[:200]!r}")
    payload = json.loads(content)
    if not payload.get("choices"):
        raise RuntimeError(f"{who} answered without choices: {content[:200]!r}")
    return payload


def _check_answer(status: int, content: bytes, stream: bool, who: str) -> None:
    if not stream:
        _checked_json(status, content, who)
        return
    if status != 200:
        raise RuntimeError(f"{who} answered {status}: {content[:200]!r}")
    if b'"error"' in content or not content.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"{who} stream did not end cleanly: {content[-200:]!r}")


def run_rounds(target: Target, prompts: list[str], max_tokens: int, seed: int, warmup: int,
               disable_tqdm: bool = False) -> dict[str, Any]:
    """``len(prompts) // 4`` rounds after ``warmup`` rounds; each round: both paths x both modes, shuffled."""
    rng = random.Random(seed)
    runs = [(path, mode) for path in PATHS for mode in MODES]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    rounds: list[dict[str, float]] = []
    failed, errors = {f"{p}_{m}": 0 for p, m in runs}, []
    num_rounds = len(prompts) // len(runs)
    for i in tqdm(range(num_rounds), desc="rounds", disable=disable_tqdm):
        order, row = rng.sample(runs, len(runs)), {}
        for k, (path, mode) in enumerate(order):
            call = by_hand if path == "hand" else through_proxy
            try:
                elapsed = call(target, prompts[i * len(runs) + k], max_tokens, mode == "stream")
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failed[f"{path}_{mode}"] += i >= warmup
                errors.append(f"{path} {mode}: {type(exc).__name__}: {exc}"[:300])
                continue
            if i >= warmup:
                times[(path, mode)].append(elapsed)
                row[f"{path}_{mode}"] = elapsed
        rounds.append(row)
    return _summary(times, rounds[warmup:], failed, errors)


def _summary(times, rounds, failed, errors) -> dict[str, Any]:
    out: dict[str, Any] = {path: {} for path in PATHS}
    out["added"] = {}
    for mode in (*MODES, "all"):
        modes = MODES if mode == "all" else (mode,)
        for path in PATHS:
            out[path][mode] = _stats([t for m in modes for t in times[(path, m)]])
        paired = [r[f"proxy_{m}"] - r[f"hand_{m}"] for r in rounds for m in modes
                  if f"proxy_{m}" in r and f"hand_{m}" in r]
        out["added"][mode] = {"p50_ms": out["proxy"][mode]["p50_ms"] - out["hand"][mode]["p50_ms"],
                              "p99_ms": out["proxy"][mode]["p99_ms"] - out["hand"][mode]["p99_ms"],
                              "paired_median_ms": _ms(np.median(paired)) if paired else float("nan")}
    out["failed"], out["errors"] = failed, errors[:10]
    return out


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"n": len(values), "mean_ms": _ms(np.mean(values)), "p50_ms": _ms(np.median(values)),
            "p99_ms": _ms(np.percentile(values, 99))}


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1000, 3)


def hardware() -> str:
    return f"{platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, {platform.platform()}"


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    print(f"\nproxy overhead: {config['requests']} rounds of 4 requests, {config['prompt_tokens']}-token prompts "
          f"(by hand as {config['hand_prompt']}), max_tokens {config['max_tokens']}; {config['hardware']}")
    print(f"{'mode':<8}{'hand p50':>10}{'hand p99':>10}{'proxy p50':>11}{'proxy p99':>11}"
          f"{'added p50':>11}{'added p99':>11}{'paired p50':>12}   (ms)")
    for mode in (*MODES, "all"):
        h, p, a = result["hand"][mode], result["proxy"][mode], result["added"][mode]
        print(f"{mode:<8}{h['p50_ms']:>10.2f}{h['p99_ms']:>10.2f}{p['p50_ms']:>11.2f}{p['p99_ms']:>11.2f}"
              f"{a['p50_ms']:>11.2f}{a['p99_ms']:>11.2f}{a['paired_median_ms']:>12.2f}")
    if any(result["failed"].values()):
        print(f"failed: {result['failed']}; first errors: {result['errors'][:3]}")


def run(args) -> dict[str, Any]:
    from pdserve.engine.text.tokenizer import load_tokenizer

    with ExitStack() as stack:
        if args.proxy_url:
            urls, model_dir = (args.prefill_url, args.decode_url, args.proxy_url), args.model
            if not all(urls) or not model_dir:
                raise SystemExit("--proxy-url needs --prefill-url, --decode-url and --model (the tokenizer)")
        else:
            model_dir = args.model or _tiny_model(stack)
            cluster = stack.enter_context(_cluster(model_dir))
            urls = (cluster.prefill_urls[0], cluster.decode_urls[0], cluster.url)
        tokenizer = load_tokenizer(model_dir)
        prompts = make_prompts(tokenizer, 4 * (args.requests + args.warmup), args.prompt_tokens, args.seed)
        target = Target(*urls, model=_model_name(urls[2]))
        stack.callback(target.close)
        if args.hand_prompt == "ids":
            target.hand_ids = {p: tokenizer.encode(p) for p in prompts}
        result = run_rounds(target, prompts, args.max_tokens, args.seed, args.warmup, args.disable_tqdm)
    result["config"] = {"requests": args.requests, "warmup": args.warmup, "prompt_tokens": args.prompt_tokens,
                        "max_tokens": args.max_tokens, "hand_prompt": args.hand_prompt, "seed": args.seed,
                        "hardware": hardware(), "prefill_url": urls[0], "decode_url": urls[1], "proxy_url": urls[2]}
    return result


def _tiny_model(stack: ExitStack) -> str:
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-proxy-overhead-"))
    return str(make_tiny_model(Path(tmp) / "llama", arch="llama", seed=0))


def _cluster(model_dir: str):
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    return LocalCluster(model_dir, ClusterSpec())


def _model_name(proxy_url: str) -> str:
    conn = Conn(proxy_url)
    try:
        return json.loads(conn.request("GET", "/v1/models")[1])["data"][0]["id"]
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: a generated tiny llama)")
    ap.add_argument("--prefill-url", default=None)
    ap.add_argument("--decode-url", default=None)
    ap.add_argument("--proxy-url", default=None, help="with --prefill-url/--decode-url: use running servers")
    ap.add_argument("--requests", type=int, default=200, help="rounds measured (each: 4 requests)")
    ap.add_argument("--warmup", type=int, default=10, help="rounds run first and not counted")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--hand-prompt", default="text", choices=["text", "ids"],
                    help="what the hand path sends: the text (each node tokenizes it, as a client would) or its "
                         "token ids (nobody tokenizes: the proxy's own tokenizing then counts in its added latency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    result = run(args)
    print_table(result)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0 if not any(result["failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
