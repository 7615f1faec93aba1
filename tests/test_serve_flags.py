"""`pdserve serve` passes node flags through: to every node, and per role (parallel layouts, free-form args).

Started as the README starts it; each node's own answers and start-up log show what it got — not the
command line we built: the decode node runs tp 2 and the prefill node a shorter --max-model-len given
only through --prefill-args, both with --dtype float32 and --block-size 8; a completion through the proxy
still works. Mutation caught: dropping ``ClusterSpec.decode_flags`` from the node command line (the
decode node then starts without its ranks).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx

from serve_process import banner_url, serve


def test_serve_passes_flags_to_every_node_and_per_role(tiny_llama):
    flags = ("--dtype", "float32", "--block-size", "8", "--max-model-len", "512", "--decode-tensor-parallel-size", "2",
             "--prefill-args", "--max-model-len 384", "--api-key", "proxy-key")
    with serve(tiny_llama, *flags) as (proc, output):
        url = banner_url(output)
        urls = {role: re.search(rf"{role}\s+(http://\S+)", output).group(1) for role in ("prefill", "decode")}
        logs = Path(re.search(r"logs\s+(\S+)", output).group(1))
        node_key = _node_api_key(logs)           # nodes on loopback answer only the proxy (and whoever has it)
        assert all(httpx.get(u + "/v1/models", timeout=10).status_code == 401 for u in urls.values())
        auth = {"Authorization": f"Bearer {node_key}"}
        lens = {role: httpx.get(url + "/v1/models", timeout=10, headers=auth).json()["data"][0]["max_model_len"]
                for role, url in urls.items()}
        assert lens == {"prefill": 384, "decode": 512}
        decode_log, prefill_log = (logs / "decode-0.log").read_text(), (logs / "prefill-0.log").read_text()
        assert "2 worker ranks ready (tp 2 x pp 1)" in decode_log
        assert "worker ranks" not in prefill_log
        for log in (decode_log, prefill_log):
            assert re.search(r"engine ready: .* dtype=torch\.float32 blocks=\d+ x 8 tokens", log), log[-2000:]
        body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", timeout=60, json=body).status_code == 401   # --api-key
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=body, headers={"Authorization": "Bearer proxy-key"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        _check_the_token_stays_secret(logs, output)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_serve_routing_by_cache_wires_events_store_and_threshold(tiny_llama):
    """--routing-policy kv_aware: nodes publish KV events, the proxy holds the token (environment only) and the store's
    address; a short prompt is prefilled by the decode node (its decision in usage.kv_transfer.route)."""
    with serve(tiny_llama, "--routing-policy", "kv_aware", "--local-prefill-threshold", "64") as (proc, output):
        url, logs = banner_url(output), Path(re.search(r"logs\s+(\S+)", output).group(1))
        decode = re.search(r"decode\s+(http://\S+)", output).group(1)
        auth = {"Authorization": f"Bearer {_node_api_key(logs)}"}
        card = httpx.get(decode + "/v1/models", timeout=10, headers=auth).json()["data"][0]["kv"]
        assert card["events"].startswith("tcp://127.0.0.1:") and card["store"]["num_layers"] > 0
        proxies = [(c, e) for c, e in _children(logs).values() if " proxy " in c]
        assert len(proxies) == 1 and "PDSERVE_KV_AUTH_TOKEN" in proxies[0][1] and "--kv-store tcp://" in proxies[0][0]
        assert "--routing-policy kv_aware" in proxies[0][0] and proxies[0][1]["PDSERVE_KV_AUTH_TOKEN"] not in \
            proxies[0][0]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["kv_transfer"]["route"]["decision"] == "decode_local"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def _children(logs: Path) -> dict[str, tuple[str, dict]]:
    """pid -> (command line, environment) of every process the cluster started (their cwd is its log dir)."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(logs):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
                children[pid] = (cmdline, environ)
        except OSError:
            continue
    return children


def _node_api_key(logs: Path) -> str:
    keys = {env.get("PDSERVE_API_KEY") for cmd, env in _children(logs).values() if " node " in cmd} - {None}
    assert len(keys) == 1 and len(keys.copy().pop()) >= 32, "every node has the one random key"
    return keys.pop()


def _check_the_token_stays_secret(logs: Path, banner: str) -> None:
    """The cluster's KV token reaches the daemon and the nodes in their environment only: on no command line
    (every local user reads those), in no log, not in the proxy."""
    assert re.search(r"store\s+tcp://\S+ \(authenticated, key id [0-9a-f]{8}\)", banner), banner
    children = _children(logs)
    tokens = {env.get("PDSERVE_KV_AUTH_TOKEN") for _, env in children.values()} - {None}
    assert len(tokens) == 1, tokens                                  # one key, shared by the daemon and nodes
    token = tokens.pop()
    assert len(token) >= 32
    for cmdline, env in children.values():
        assert token not in cmdline
        if " proxy " in cmdline:
            assert "PDSERVE_KV_AUTH_TOKEN" not in env
    assert any(" kvstore " in c and "PDSERVE_KV_AUTH_TOKEN" in e for c, e in children.values())
    for log in logs.glob("*.log"):
        assert token not in log.read_text(errors="replace"), log
    assert token not in banner