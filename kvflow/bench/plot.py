"""The ``--sweep-rates`` plot: latency percentiles against achieved output throughput, one
line per server (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

import json
from typing import Any

# (result key, panel title); p50 drawn solid, p99 dashed
PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))


def load_sweep(path: str) -> tuple[str, list[dict[str, Any]]]:
    """(label, runs) from a ``--result-json`` file of a sweep (or of a single run).

    Raises:
        ValueError: if the file holds neither.
    """
    with open(path) as f:
        doc = json.load(f)
    if "sweep" in doc:
        return doc["label"], doc["sweep"]
    if "output_throughput" in doc:
        return doc["label"], [doc]
    raise ValueError(f"{path} is not a kvflow bench serve result")


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
