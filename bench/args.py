"""Flags of ``pdserve bench serve`` and ``pdserve bench sweep``, named as in ``vllm bench serve``.

Called by ``cli``: ``add_workload_args`` (dataset, traffic, sampling, reporting) is shared by both
commands; ``bench_config(args, base_url)`` turns parsed flags into a frozen ``BenchConfig``.
"""

from __future__ import annotations

import argparse
import math

from pdserve.bench.client import BACKENDS
from pdserve.bench.datasets import NAMES, DatasetConfig
from pdserve.bench.datasets_rounds import HISTORIES
from pdserve.bench.metrics import METRIC_NAMES, parse_goodput
from pdserve.bench.runner import TrafficConfig
from pdserve.bench.serve import BenchConfig

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server base URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="scrape URL/metrics for the pdserve KV block (repeatable; default: the base URL)")


def add_workload_args(p: argparse.ArgumentParser, target_model: bool = True) -> None:
    """``target_model=False`` (sweep): --model names the model dir the sweep serves, added by ``sweep``."""
    p.add_argument("--backend", default="openai", choices=sorted(BACKENDS))
    p.add_argument("--endpoint", default=None, help="default: /v1/completions, or /v1/chat/completions for openai-chat")
    if target_model:
        p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
        p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model id)")
    p.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE")
    _add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    for name in SAMPLING:
        p.add_argument("--" + name.replace("_", "-"), type=int if name == "top_k" else float, default=None)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"from {','.join(METRIC_NAMES)}")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--disable-tqdm", action="store_true")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    d = DatasetConfig()
    p.add_argument("--dataset-name", default="random", choices=NAMES + ("prefix-repetition",))
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    for name in [f for f in DatasetConfig.__dataclass_fields__ if f not in ("name", "num_prompts", "seed", "path")]:
        default = getattr(d, name)
        kind = float if isinstance(default, float) else str if isinstance(default, str) else int
        choices = HISTORIES if name == "multi_round_history" else None
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, choices=choices)


def dataset_config(args) -> DatasetConfig:
    fields = {f: getattr(args, f) for f in DatasetConfig.__dataclass_fields__
              if f not in ("name", "num_prompts", "seed", "path")}
    if args.input_len is not None:
        fields["random_input_len"] = args.input_len
    if args.output_len is not None:
        for key in ("random_output_len", "prefix_repetition_output_len", "sharegpt_output_len",
                    "multi_round_answer_len", "long_doc_output_len"):
            fields[key] = args.output_len
    return DatasetConfig(name=args.dataset_name.replace("-", "_"), num_prompts=args.num_prompts, seed=args.seed,
                         path=args.dataset_path, **fields)


def bench_config(args, base_url: str, metrics_urls: tuple[str, ...] = ()) -> BenchConfig:
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    bad = [m for m in metrics if m not in METRIC_NAMES]
    if bad:
        raise ValueError(f"--percentile-metrics {bad} not among {', '.join(METRIC_NAMES)}")
    dataset = dataset_config(args)
    return BenchConfig(
        base_url=base_url, endpoint=args.endpoint or BACKENDS[args.backend], backend=args.backend,
        model=getattr(args, "target_model", args.model), served_model_name=getattr(args, "served_model_name", None),
        tokenizer=args.tokenizer, dataset=dataset,
        traffic=TrafficConfig(args.request_rate, args.burstiness, args.max_concurrency, args.num_warmups,
                              args.seed, args.disable_tqdm),
        ignore_eos=args.ignore_eos or dataset.name == "random",     # vLLM: random always runs to length
        sampling={k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None},
        headers=_pairs(args.header, "--header"),
        percentile_metrics=metrics, percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")),
        goodput=parse_goodput(args.goodput), metrics_urls=metrics_urls or tuple(getattr(args, "metrics_url", ())),
        label=getattr(args, "label", None), metadata=_pairs(getattr(args, "metadata", None), "--metadata"),
        save_detailed=getattr(args, "save_detailed", False))


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
