"""``pdserve bench serve``, ``pdserve bench sweep`` and ``pdserve bench kvstore``.

``register(subparsers)`` is called by ``pdserve.engine.cli``; ``python -m pdserve.bench.cli serve ...``
runs the same commands stand-alone.

    pdserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 512 \\
        --random-output-len 64 --num-prompts 32 --save-result --plot run.png
    pdserve bench sweep --model DIR --mode colocated,disagg,disagg+warm-store \\
        --param max_num_batched_tokens=256,512,1024 --num-prompts 16 --output-dir sweep/
    pdserve bench kvstore --json kv.json       # the store's data plane vs memcpy / raw pyzmq / raw redis-py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import datetime

from pdserve.bench import args as bench_args


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server like `vllm bench serve`, or sweep settings")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="one benchmark run against any OpenAI-compatible server")
    bench_args.add_target_args(serve)
    bench_args.add_workload_args(serve)
    _add_output_args(serve)
    serve.set_defaults(func=run_serve)
    sweep = sub.add_parser("sweep", help="launch a local cluster per setting and run the same workload on each")
    from pdserve.bench.sweep import add_sweep_args

    add_sweep_args(sweep)
    bench_args.add_workload_args(sweep, target_model=False)
    sweep.set_defaults(target_model=None)
    sweep.set_defaults(func=run_sweep)
    kv = sub.add_parser("kvstore", help="the KV store's put/get GB/s per path against raw baselines from the same run")
    from pdserve.bench.kvstore_bench import add_arguments as add_kvstore_args

    add_kvstore_args(kv)
    kv.set_defaults(func=run_kvstore)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's keys + 'pdserve')")
    p.add_argument("--save-detailed", action="store_true", help="include per-request ttfts, itls, texts, errors")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None)
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="TTFT/ITL CDFs and a request timeline")


def run_serve(args) -> int:
    from pdserve.bench.serve import run_bench

    _quiet_libraries()
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        cfg = bench_args.bench_config(args, base_url)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench serve: {exc}") from None
    try:
        res = run_bench(cfg)
    except (RuntimeError, FileNotFoundError) as exc:     # server unreachable, tokenizer not found
        raise SystemExit(f"pdserve bench serve: {exc}") from None
    print(res.table)
    for err in [o.error for o in res.outputs if not o.success][:10]:
        print(f"failed request: {err.strip()[:300]}", file=sys.stderr)
    if args.save_result:
        print(f"result written to {_save_result(args, res, cfg)}")
    if args.plot:
        from pdserve.bench.plots import plot_run

        print(f"plot written to {plot_run(res.outputs, args.plot, _title(res))}")
    return 0 if res.metrics.completed else 1


def _save_result(args, res, cfg) -> str:
    """vLLM's file name (or --result-filename) in --result-dir; the date in it is the file's."""
    from pdserve.bench.report import result_filename

    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    res.result["date"] = date
    name = args.result_filename or result_filename(_run_info(res, cfg), date)
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "w", encoding="utf-8") as f:
        json.dump(res.result, f)
    return name


def _quiet_libraries() -> None:
    """httpx logs one INFO line per request, matplotlib its font and axis choices."""
    for name in ("httpx", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _run_info(res, cfg):
    from pdserve.bench.report import RunInfo

    return RunInfo(cfg.backend, res.result["model_id"], res.result["tokenizer_id"], res.result["num_prompts"],
                   cfg.traffic.request_rate, cfg.traffic.burstiness, cfg.traffic.max_concurrency,
                   res.result["duration"], label=cfg.label)


def _title(res) -> str:
    r = res.result
    return (f"{r['model_id']} | {r['pdserve']['dataset']} x {r['num_prompts']} | rate {r['request_rate']} | "
            f"{r['output_throughput']:.1f} out tok/s, mean TTFT {r.get('mean_ttft_ms', 0):.1f} ms")


def run_sweep(args) -> int:
    _quiet_libraries()
    from pdserve.bench.sweep import run_sweep_command

    return run_sweep_command(args)


def run_kvstore(args) -> int:
    from pdserve.bench.kvstore_bench import run_command

    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
