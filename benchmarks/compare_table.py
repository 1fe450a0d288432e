"""Print the side-by-side table of ``kvflow bench serve`` results written by compare_cpu.sh:
one row per (rate, engine, round) plus medians over rounds, then each peer's ratios against
kvflow at the same rate (from the medians). Labels ``engine@dtype`` (several dtypes measured)
are compared at each engine's best dtype (highest median output throughput at that rate).

    python benchmarks/compare_table.py out/compare_cpu/*.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict

COLUMNS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def load(paths: list[str]) -> dict[str, dict[str, list[dict]]]:
    """{rate: {engine label: [result of each round]}} from single-run result files."""
    by_rate: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(paths):
        with open(path) as f:
            r = json.load(f)
        by_rate[str(r["request_rate"])][r["label"]].append(r)
    return by_rate


def median(results: list[dict], key: str) -> float:
    """Median of ``key`` over the runs; NaN when no run has it (a result JSON writes a
    statistic of no values, such as TPOT with one-token outputs, as null)."""
    values = [r[key] for r in results if r[key] is not None]
    return statistics.median(values) if values else math.nan


def rows(by_rate: dict[str, dict[str, list[dict]]]) -> list[str]:
    """One row per run (round) and, with several rounds, a row of medians per engine."""
    header = (f"{'rate':>5} {'engine':<17} {'round':>6} {'done':>5} {'out tok/s':>10} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    out = [header]
    for rate, engines in by_rate.items():
        for label, results in engines.items():
            for i, r in enumerate(results, 1):
                vals = " ".join(f"{median([r], c):>9.1f}" for c in COLUMNS[1:])
                out.append(f"{rate:>5} {label:<17} {i:>6} {r['completed']:>5} "
                           f"{r['output_throughput']:>10.1f} {vals}")
            if len(results) > 1:
                vals = " ".join(f"{median(results, c):>9.1f}" for c in COLUMNS[1:])
                out.append(f"{rate:>5} {label:<17} {'median':>6} {'':>5} "
                           f"{median(results, COLUMNS[0]):>10.1f} {vals}")
    return out


def best_by_engine(engines: dict[str, list[dict]]) -> dict[str, tuple[str, list[dict]]]:
    """{engine: (label, runs)} keeping, per engine (the label before ``@``), the label with the
    highest median output throughput (its best dtype)."""
    best: dict[str, tuple[str, list[dict]]] = {}
    for label, results in engines.items():
        engine = label.split("@")[0]
        if engine not in best or median(results, "output_throughput") > \
                median(best[engine][1], "output_throughput"):
            best[engine] = (label, results)
    return best


def ratios(by_rate: dict[str, dict[str, list[dict]]]) -> list[str]:
    """kvflow throughput / peer throughput and peer latency / kvflow latency (> 1: kvflow
    better), from the medians over rounds, each engine at its best dtype."""
    out = []
    for rate, engines in by_rate.items():
        best = best_by_engine(engines)
        if "kvflow" not in best:
            continue
        k_label, k = best["kvflow"]
        for engine, (label, r) in best.items():
            if engine == "kvflow":
                continue
            rounds = f" (medians of {len(k)} / {len(r)} runs)" if len(k) > 1 or len(r) > 1 else ""
            out.append(f"rate {rate}: {k_label} / {label}: output throughput "
                       f"{median(k, 'output_throughput') / median(r, 'output_throughput'):.2f}x, "
                       f"p99 TTFT {median(r, 'p99_ttft_ms') / median(k, 'p99_ttft_ms'):.2f}x, "
                       f"p99 TPOT {median(r, 'p99_tpot_ms') / median(k, 'p99_tpot_ms'):.2f}x "
                       f"better{rounds}")
    return out or ["no peer results: only kvflow ran (install a peer, see the script header)"]


def main(paths: list[str]) -> None:
    by_rate = load(paths)
    print("\n".join(rows(by_rate) + [""] + ratios(by_rate)))


if __name__ == "__main__":
    main(sys.argv[1:])
