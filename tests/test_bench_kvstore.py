"""``pdserve bench kvstore`` (issue 40): a real run, small, through the CLI; every row against its baseline."""

from __future__ import annotations

import json

from pdserve.bench.cli import main


def test_bench_kvstore_prints_the_table_and_writes_every_ratio(tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["kvstore", "--total-mib", "1", "--sizes", "64KiB", "--repeats", "3", "--seed", "3",
                 "--redis-url", "", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert set(rows) == {"memcpy", "raw pyzmq", "memory tier", "daemon shm", "daemon tcp", "disk tier (page cache)"}
    assert rows["daemon tcp"]["baseline"] == "raw pyzmq" and rows["daemon shm"]["baseline"] == "memcpy"
    for r in rows.values():
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0
        assert abs(r["put_ratio"] - r["put_gbps"] / rows[r["baseline"]]["put_gbps"]) < 1e-9
        base = rows[r["baseline"]]                             # paired: round r of the path against round r of its
        assert len(r["put_s"]) == len(r["get_s"]) == 3         # baseline, the median of the three
        assert r["get_paired"] == sorted(b / p for b, p in zip(base["get_s"], r["get_s"]))[1]
    assert rows["daemon shm"]["goal"] == 0.5 and result["seed"] == 3
    printed = capsys.readouterr()
    assert "daemon shm" in printed.out and "raw pyzmq" in printed.out
    assert "[1/1 64KiB] round 3/3" in printed.err             # progress, on stderr
