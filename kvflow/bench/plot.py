"""The ``--sweep-rates`` plot: latency percentiles against achieved output throughput, one
line per server (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

import json
from typing import Any

# (result key, panel title); p50 drawn solid, p99 dashed
PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))
# the fields of a run that plot_sweeps reads
RUN_FIELDS = ("output_throughput", *(f"{stat}_{key}_ms" for key, _ in PANELS
                                     for stat in ("median", "p99")))


def load_sweep(path: str) -> tuple[str, list[dict[str, Any]]]:
    """(label, runs) from a ``--result-json`` file of a sweep (or of a single run); the label
    is the file name when the file has none.

    Raises:
        OSError: when the file cannot be read.
        ValueError: saying why the file is not such a result (not UTF-8 JSON, not an object,
            a run without one of ``RUN_FIELDS``).
    """
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")  # noqa: TRY004
    runs = doc.get("sweep", [doc])
    if not isinstance(runs, list) or not runs:
        raise ValueError("\"sweep\" is not a list of runs")
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or not isinstance(run.get("output_throughput"),
                                                       (int, float)):
            raise ValueError(f"run {i} has no numeric output_throughput")  # noqa: TRY004
        missing = [k for k in RUN_FIELDS if k not in run]
        if missing:
            raise ValueError(f"run {i} lacks {', '.join(missing)}")
    return str(doc.get("label") or path), runs


def plot_sweeps(sweeps: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    """Write a PNG to ``path``: one panel per metric in ``PANELS``, x = output tokens/s,
    y = median (solid) and p99 (dashed) latency in ms, one colour per (label, runs) pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    for i, (label, runs) in enumerate(sweeps):
        runs = sorted(runs, key=lambda r: r["output_throughput"])
        x = [r["output_throughput"] for r in runs]
        for ax, (key, title) in zip(axes, PANELS):
            color = f"C{i}"
            ax.plot(x, [r[f"median_{key}_ms"] for r in runs], "o-", color=color,
                    label=f"{label} p50")
            ax.plot(x, [r[f"p99_{key}_ms"] for r in runs], "s--", color=color,
                    label=f"{label} p99")
            ax.set_title(title)
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
