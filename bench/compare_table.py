"""Print pdserve / vLLM ratios for the same fixed-seed workload (used by ``bench/compare_vllm.sh``).

    python -m pdserve.bench.compare_table --vllm-colocated A.json --vllm-disagg B.json --pdserve-sweep sweep.json

The vLLM files are ``pdserve bench serve --save-result`` runs against vLLM; the sweep is
``pdserve bench sweep --mode colocated,disagg`` with the same workload flags. Ratio > 1 means
pdserve is ahead for throughput, behind for latencies; the "pdserve ahead" column says which.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = (("output_throughput", "output tok/s", True), ("mean_ttft_ms", "mean TTFT (ms)", False),
           ("p99_ttft_ms", "p99 TTFT (ms)", False), ("mean_tpot_ms", "mean TPOT (ms)", False),
           ("p99_itl_ms", "p99 ITL (ms)", False))


def sweep_results(path: str) -> dict[str, dict]:
    """{"colocated": result, "disagg": result} from a sweep.json (first setting of each mode)."""
    data = json.loads(Path(path).read_text())
    out: dict[str, dict] = {}
    for row in data["rows"]:
        out.setdefault(row["mode"], data["results"][row["setting"]])
    return out


def table(pairs: list[tuple[str, dict, dict]]) -> str:
    lines = ["| setup | metric | vLLM | pdserve | pdserve/vLLM | pdserve ahead |", "|---|---|---|---|---|---|"]
    for setup, vllm, ours in pairs:
        for key, label, higher_better in METRICS:
            v, p = vllm.get(key), ours.get(key)
            if v is None or p is None:
                lines.append(f"| {setup} | {label} | {v} | {p} | - | - |")
                continue
            ratio = p / v if v else float("inf")
            ahead = ratio > 1 if higher_better else ratio < 1
            lines.append(f"| {setup} | {label} | {v:.2f} | {p:.2f} | {ratio:.2f} | {'yes' if ahead else 'NO'} |")
        lines.append(f"| {setup} | failed requests | {vllm.get('failed')} | {ours.get('failed')} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-colocated", required=True)
    p.add_argument("--vllm-disagg", default=None)
    p.add_argument("--pdserve-sweep", required=True)
    args = p.parse_args(argv)
    ours = sweep_results(args.pdserve_sweep)
    pairs = [("colocated", json.loads(Path(args.vllm_colocated).read_text()), ours.get("colocated", {}))]
    if args.vllm_disagg:
        pairs.append(("1P1D", json.loads(Path(args.vllm_disagg).read_text()), ours.get("disagg", {})))
    print(table(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
