"""``--plot FILE.png``: one PNG of a run's records (matplotlib, the ``bench`` extra).

One row of panels per model, one panel per test (pp and tg differ by orders of magnitude,
so each panel has its own scale): a bar per backend, ± stddev, labelled with its % of
native. With several models (a size sweep) a last panel draws % native against the
parameter count for every non-native backend and test: the remoting overhead curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .errors import BenchError
from .report import fmt_params

COLORS = {"native": "#4c72b0", "remote-shm": "#55a868", "remote-tcp": "#dd8452",
          "guest-cpu": "#c44e52"}


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'apir[bench]'") from None


def plot(records: Sequence[dict], path: str | Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    tests = list(dict.fromkeys(r["test"] for r in records))
    backends = list(dict.fromkeys(r["backend"] for r in records))
    by_key = {(r["model"], r["test"], r["backend"]): r for r in records}
    sweep = len(models) > 1 and any(r["pct_native"] is not None and r["backend"] != "native"
                                    for r in records)
    n_rows = len(models) + sweep
    fig = plt.figure(figsize=(max(4.0 * len(tests), 6.0), 3.6 * n_rows), layout="constrained")
    grid = fig.add_gridspec(n_rows, len(tests))
    for i, model in enumerate(models):
        for j, test in enumerate(tests):
            ax = fig.add_subplot(grid[i, j])
            rows = [by_key[k] for b in backends if (k := (model, test, b)) in by_key]
            _bars(ax, rows)
            ax.set_title(f"{model} · {test}", fontsize=10)
            if j == 0:
                ax.set_ylabel("tokens/s")
    if sweep:
        _overhead(fig.add_subplot(grid[-1, :]), records, models, tests, backends)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(ax, rows: Sequence[dict]) -> None:
    xs = range(len(rows))
    bars = ax.bar(xs, [r["avg_ts"] for r in rows], yerr=[r["stddev_ts"] for r in rows],
                  color=[COLORS.get(r["backend"], "#8c8c8c") for r in rows], capsize=3)
    labels = ["" if r["pct_native"] is None else f"{r['pct_native']:.0f}%" for r in rows]
    ax.bar_label(bars, labels, padding=2, fontsize=8)
    ax.set_xticks(list(xs), [r["backend"] for r in rows], fontsize=8)
    ax.margins(y=0.15)


def _overhead(ax, records, models, tests, backends) -> None:
    params = {r["model"]: r["model_params"] for r in records}
    order = sorted(models, key=params.get)
    for b in backends:
        if b == "native":
            continue
        for test in tests:
            pts = [(params[m], r["pct_native"]) for m in order for r in records
                   if r["model"] == m and r["test"] == test and r["backend"] == b
                   and r["pct_native"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{b} {test}",
                        color=COLORS.get(b), linestyle="-" if test.startswith("tg") else "--")
    ax.axhline(100, color="#4c72b0", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xticks([params[m] for m in order], [f"{m}\n{fmt_params(params[m])}" for m in order],
                  fontsize=8)
    ax.minorticks_off()
    ax.set_ylabel("% of native")
    ax.set_title("throughput relative to native vs model size", fontsize=10)
    ax.legend(fontsize=8)
