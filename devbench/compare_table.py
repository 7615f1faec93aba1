"""Print pdserve / vLLM ratios for the same fixed-seed workload (used by ``devbench/compare_vllm.sh``).

    python devbench/compare_table.py --vllm-colocated A.json --vllm-disagg B.json --pdserve-sweep sweep.json
    python devbench/compare_table.py --rounds ROUND_DIR [ROUND_DIR ...]

The vLLM files are ``pdserve bench serve --save-result`` runs against vLLM; the sweep is
``pdserve bench sweep --mode colocated,disagg`` with the same workload flags. Ratio > 1 means
pdserve is ahead for throughput, behind for latencies; the "pdserve ahead" column says which.

``--rounds``: directories of repeated comparisons (each holding ``vllm-colocated.json``, maybe
``vllm-disagg.json``, and ``pdserve/sweep.json``), the servers' order alternating round to round so a
shared box's drift falls on both alike. Prints each metric's median over the rounds, for vLLM, pdserve
and the per-round ratio, with the ratios' range: one round's ratio moves by 10-20% on a noisy box.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def round_pairs(run: Path) -> list[tuple[str, dict, dict]]:
    """One round's (setup, vLLM result, pdserve result) pairs from its directory."""
    ours = sweep_results(str(run / "pdserve" / "sweep.json"))
    pairs = [("colocated", json.loads((run / "vllm-colocated.json").read_text()), ours.get("colocated", {}))]
    if (run / "vllm-disagg.json").exists():
        pairs.append(("1P1D", json.loads((run / "vllm-disagg.json").read_text()), ours.get("disagg", {})))
    return pairs


def rounds_table(rounds: list[list[tuple[str, dict, dict]]]) -> str:
    """Medians over rounds of each side's figure and of the per-round ratio, with the ratios' range."""
    lines = [f"| setup | metric | vLLM (median of {len(rounds)}) | pdserve (median) | pdserve/vLLM (median) | "
             "ratio range | pdserve ahead |", "|---|---|---|---|---|---|---|"]
    for i, (setup, _, _) in enumerate(rounds[0]):
        for key, label, higher_better in METRICS:
            got = [(r[i][1].get(key), r[i][2].get(key)) for r in rounds if len(r) > i]
            got = [(v, p) for v, p in got if v and p is not None]
            if not got:
                lines.append(f"| {setup} | {label} | - | - | - | - | - |")
                continue
            ratios = [p / v for v, p in got]
            ratio = statistics.median(ratios)
            ahead = ratio > 1 if higher_better else ratio < 1
            vllm, ours = statistics.median(v for v, _ in got), statistics.median(p for _, p in got)
            lines.append(f"| {setup} | {label} | {vllm:.2f} | {ours:.2f} | {ratio:.2f} | "
                         f"{min(ratios):.2f}-{max(ratios):.2f} | {'yes' if ahead else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-colocated")
    p.add_argument("--vllm-disagg", default=None)
    p.add_argument("--pdserve-sweep")
    p.add_argument("--rounds", nargs="+", type=Path, help="round directories: print medians over them")
    args = p.parse_args(argv)
    if args.rounds:
        print(rounds_table([round_pairs(d) for d in args.rounds]))
        return 0
    if not (args.vllm_colocated and args.pdserve_sweep):
        p.error("--vllm-colocated and --pdserve-sweep are required without --rounds")
    ours = sweep_results(args.pdserve_sweep)
    pairs = [("colocated", json.loads(Path(args.vllm_colocated).read_text()), ours.get("colocated", {}))]
    if args.vllm_disagg:
        pairs.append(("1P1D", json.loads(Path(args.vllm_disagg).read_text()), ours.get("disagg", {})))
    print(table(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
