"""``pdserve bench sweep``: a local cluster per setting, the same fixed-seed workload on each.

Called by ``cli.run_sweep``. Settings are the product of ``--mode`` and every ``--param``:

    --mode colocated,disagg,disagg+warm-store   colocated: one --role both node, benchmarked directly
                                                disagg: proxy -> prefill node(s) -> store -> decode node(s)
                                                disagg+warm-store: disagg, after one unmeasured pass of
                                                the same prompts has filled the store
    --param max_num_batched_tokens=256,512      any `pdserve node` flag (underscores for dashes)
    --param prefill=1,2 decode=1,2              P:D node counts (disaggregated modes only)
    --overhead                                  also vLLM's disaggregation-overhead method (``overhead``)

Node prefix caching is off unless ``--prefix-caching`` is given, so a warm-store hit is a store
hit, not the node's own cache. For each setting: start cluster -> (warm pass) -> run_bench with
the nodes' /metrics scraped -> (overhead) -> stop cluster -> one row. Writes sweep.md, sweep.csv,
sweep.json and PNGs into --output-dir (``sweep_table``).
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pdserve.bench import args as bench_args
from pdserve.bench import sweep_table

MODES = ("colocated", "disagg", "disagg+warm-store")
COUNT_PARAMS = ("prefill", "decode")


@dataclass(frozen=True)
class Setting:
    mode: str
    prefill: int = 1
    decode: int = 1
    node_params: tuple[tuple[str, str], ...] = ()      # (("max_num_batched_tokens", "512"), ...)

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def name(self) -> str:
        parts = [self.mode] + ([] if self.colocated else [f"{self.prefill}P{self.decode}D"])
        return " ".join(parts + [f"{k}={v}" for k, v in self.node_params])

    def node_flags(self, prefix_caching: bool, extra: tuple[str, ...]) -> tuple[str, ...]:
        flags = [] if prefix_caching else ["--no-enable-prefix-caching"]
        for key, value in self.node_params:
            flags += ["--" + key.replace("_", "-"), value]
        return tuple(flags) + extra


def add_sweep_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory (or a known name, e.g. smollm2-135m-instruct)")
    p.add_argument("--mode", default="colocated,disagg", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--param", nargs="+", action="extend", default=[], metavar="NAME=V1,V2",
                   help="node flag (or prefill / decode count) and its values")
    p.add_argument("--overhead", action="store_true", help="also measure the decode node's TTFT after a prefill")
    p.add_argument("--overhead-prompts", type=int, default=8)
    p.add_argument("--prefix-caching", action="store_true", help="keep the nodes' own prefix caching on")
    p.add_argument("--node-args", default="", help="extra flags for every node, one quoted string")
    p.add_argument("--output-dir", default=None, help="default: bench-sweep-<date>")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--no-plots", action="store_true")


def parse_params(items: list[str]) -> dict[str, list[str]]:
    params: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--param {item!r}: expected NAME=V1,V2,...")
        params[name.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    return params


def settings(modes: list[str], params: dict[str, list[str]]) -> list[Setting]:
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--mode {bad} not among {', '.join(MODES)}")
    counts = {k: [int(v) for v in params.get(k, ["1"])] for k in COUNT_PARAMS}
    node = {k: v for k, v in params.items() if k not in COUNT_PARAMS}
    out: list[Setting] = []
    for mode in modes:
        pd = [(1, 1)] if mode == "colocated" else list(itertools.product(counts["prefill"], counts["decode"]))
        for (p, d), values in itertools.product(pd, itertools.product(*node.values())):
            out.append(Setting(mode, p, d, tuple(zip(node, values))))
    return out


def run_sweep_command(args) -> int:
    try:
        params = parse_params(args.param)
        todo = settings([m.strip() for m in args.mode.split(",") if m.strip()], params)
        bench_args.bench_config(args, "http://127.0.0.1")        # bad workload flags fail before any cluster
    except ValueError as exc:
        raise SystemExit(f"pdserve bench sweep: {exc}") from None
    from pdserve.engine.node import resolve_model

    model_dir = str(resolve_model(args.model))
    out_dir = Path(args.output_dir or f"bench-sweep-{datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, runs = [], {}
    for i, setting in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {setting.name}", flush=True)
        row, result, outputs = run_setting(args, model_dir, setting, out_dir)
        rows.append(row)
        runs[setting.name] = (result, outputs)
    paths = sweep_table.write_all(rows, runs, out_dir, params, plots=not args.no_plots)
    print(sweep_table.markdown(rows))
    print("written: " + ", ".join(str(p) for p in paths))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def run_setting(args, model_dir: str, setting: Setting, out_dir: Path):
    from pdserve.bench.serve import run_bench
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(prefill=setting.prefill, decode=setting.decode, colocated=setting.colocated,
                       node_flags=setting.node_flags(args.prefix_caching, tuple(shlex.split(args.node_args))),
                       startup_timeout_s=args.startup_timeout)
    log_dir = out_dir / "logs" / _slug(setting.name)
    log_dir.mkdir(parents=True, exist_ok=True)
    with LocalCluster(model_dir, spec, log_dir=log_dir) as cluster:
        nodes = tuple(dict.fromkeys(cluster.prefill_urls + cluster.decode_urls))
        target = cluster.decode_urls[0] if setting.colocated else cluster.url
        cfg = bench_args.bench_config(args, target, metrics_urls=nodes)
        cfg = dataclasses.replace(cfg, tokenizer=cfg.tokenizer or model_dir,
                                  percentiles=tuple(sorted(set(cfg.percentiles) | {99.0})),
                                  metadata={**cfg.metadata, "setting": setting.name})
        if setting.mode == "disagg+warm-store":
            run_bench(dataclasses.replace(cfg, traffic=dataclasses.replace(cfg.traffic, num_warmups=0)))
        res = run_bench(cfg)
        print(res.table, flush=True)
        overhead = _overhead(args, cluster, setting, res) if args.overhead and not setting.colocated else None
    return sweep_table.row(setting, res, overhead), res.result, res.outputs


def _overhead(args, cluster, setting: Setting, res) -> dict:
    from pdserve.bench.datasets import sample_requests
    from pdserve.bench.overhead import measure_overhead
    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(res.result["tokenizer_id"])
    dataset = dataclasses.replace(bench_args.dataset_config(args), seed=args.seed + 1)   # prompts not yet stored
    prompts = [r.prompt for r in sample_requests(dataset, tokenizer)][:args.overhead_prompts]
    model = res.result["pdserve"]["model_name"]
    return measure_overhead(cluster.prefill_urls[0], cluster.decode_urls[0], model, prompts, args.backend)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=" else "_" for c in name)
