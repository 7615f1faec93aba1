"""devbench/compare_table.py --rounds: medians over repeated comparisons read from their round directories."""

from __future__ import annotations

import json
from pathlib import Path

import compare_table


def _round(d: Path, vllm_tok: float, ours_tok: float, vllm_ttft: float, ours_ttft: float, disagg: bool) -> Path:
    (d / "pdserve").mkdir(parents=True)
    res = {"output_throughput": ours_tok, "mean_ttft_ms": ours_ttft}
    rows = [{"mode": "colocated", "setting": "c"}] + ([{"mode": "disagg", "setting": "d"}] if disagg else [])
    (d / "pdserve" / "sweep.json").write_text(json.dumps({"rows": rows, "results": {"c": res, "d": res}}))
    (d / "vllm-colocated.json").write_text(json.dumps({"output_throughput": vllm_tok, "mean_ttft_ms": vllm_ttft}))
    if disagg:
        (d / "vllm-disagg.json").write_text(json.dumps({"output_throughput": vllm_tok, "mean_ttft_ms": vllm_ttft}))
    return d


def test_rounds_give_medians_of_each_side_and_of_the_per_round_ratio(tmp_path, capsys):
    dirs = [_round(tmp_path / "r1", 1000, 1500, 600, 500, True),      # ratios 1.5, 0.83
            _round(tmp_path / "r2", 1300, 1300, 500, 550, True),      # 1.0, 1.1
            _round(tmp_path / "r3", 1200, 1440, 550, 440, True)]      # 1.2, 0.8
    assert compare_table.main(["--rounds", *map(str, dirs)]) == 0
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows[("colocated", "output tok/s")] == ["1200.00", "1440.00", "1.20", "1.00-1.50", "yes"]
    assert rows[("colocated", "mean TTFT (ms)")] == ["550.00", "500.00", "0.83", "0.80-1.10", "yes"]
    assert rows[("1P1D", "output tok/s")][2] == "1.20"
    assert rows[("colocated", "p99 TTFT (ms)")] == ["-"] * 5                   # in no round's results


def test_a_round_without_disagg_and_the_single_run_form_still_work(tmp_path, capsys):
    d = _round(tmp_path / "r1", 1000, 1100, 600, 540, False)
    assert compare_table.main(["--rounds", str(d)]) == 0
    assert "1P1D" not in capsys.readouterr().out
    assert compare_table.main(["--vllm-colocated", str(d / "vllm-colocated.json"),
                               "--pdserve-sweep", str(d / "pdserve" / "sweep.json")]) == 0
    assert "| colocated | output tok/s | 1000.00 | 1100.00 | 1.10 | yes |" in capsys.readouterr().out
