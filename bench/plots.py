"""PNG plots for ``bench serve --plot`` and ``bench sweep`` (matplotlib, the ``bench`` extra).

Called by ``cli.run_serve`` (``plot_run``) and ``sweep`` (``plot_sweep``, ``plot_cdfs``):

    plot_run(outputs, "run.png", title)      TTFT CDF | ITL CDF | timeline (waiting -> first token -> last)
    plot_sweep(rows, "sweep.png", x="max_num_batched_tokens")   mean/p99 TTFT and ITL vs x, one line per mode
    plot_cdfs({"colocated": outputs, ...}, "cdf.png")           TTFT and ITL CDFs, one line per setting
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.metrics import RequestOutput


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'pdserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str | None = None) -> None:
    if not values_ms:
        return
    xs = np.sort(np.maximum(np.asarray(values_ms), 1e-3))      # > 0 for log axes
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")


def plot_run(outputs: list[RequestOutput], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    ok = [o for o in outputs if o.success]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    _cdf(a, [o.ttft * 1000 for o in ok])
    a.set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    _cdf(b, [g * 1000 for o in ok for g in o.itl])
    b.set(title="ITL CDF", xlabel="ms (log)", ylabel="fraction of gaps", xscale="log")
    _timeline(c, outputs)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _timeline(ax, outputs: list[RequestOutput]) -> None:
    """One row per request (by send time): queued, waiting for the first token, streaming."""
    if not outputs:
        return
    t0 = min(o.start_time - o.client_queue_time for o in outputs)
    for i, o in enumerate(sorted(outputs, key=lambda o: o.start_time)):
        send = o.start_time - t0
        ax.plot([send - o.client_queue_time, send], [i, i], color="lightgray", lw=2)
        if not o.success:
            ax.plot([send], [i], "rx")
            continue
        ax.plot([send, send + o.ttft], [i, i], color="tab:orange", lw=2)
        ax.plot([send + o.ttft, send + o.latency], [i, i], color="tab:blue", lw=2)
    ax.set(title="timeline: queued / to first token / streaming", xlabel="s since first request", ylabel="request")


def plot_sweep(rows: list[dict[str, Any]], path: str | Path, x: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (("mean_ttft_ms", "p99_ttft_ms", "TTFT (ms)"), ("mean_itl_ms", "p99_itl_ms", "ITL (ms)"),
              ("output_throughput", None, "output tok/s"))
    for ax, (mean_key, p99_key, label) in zip(axes, panels):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: _num(r.get(x)))
            xs = [str(r.get(x)) for r in mine]
            ax.plot(xs, [r[mean_key] for r in mine], "o-", label=f"{mode} mean" if p99_key else mode)
            if p99_key:
                ax.plot(xs, [r[p99_key] for r in mine], "x--", label=f"{mode} p99")
        ax.set(title=f"{label} vs {x}", xlabel=x, ylabel=label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_cdfs(runs: dict[str, list[RequestOutput]], path: str | Path) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, outputs in runs.items():
        ok = [o for o in outputs if o.success]
        _cdf(a, [o.ttft * 1000 for o in ok], name)
        _cdf(b, [g * 1000 for o in ok for g in o.itl], name)
    a.set(title="TTFT CDF", xlabel="ms", ylabel="fraction")
    b.set(title="ITL CDF", xlabel="ms (log)", ylabel="fraction", xscale="log")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
