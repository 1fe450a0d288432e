"""Print the side-by-side table of ``kvflow bench serve`` results written by compare_cpu.sh:
one row per (rate, engine), then each peer's ratios against kvflow at the same rate.

    python benchmarks/compare_table.py out/compare_cpu/*.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

COLUMNS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def load(paths: list[str]) -> dict[str, dict[str, dict]]:
    """{rate: {engine label: result}} from single-run result files."""
    by_rate: dict[str, dict[str, dict]] = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        by_rate[str(r["request_rate"])][r["label"]] = r
    return by_rate


def rows(by_rate: dict[str, dict[str, dict]]) -> list[str]:
    header = (f"{'rate':>5} {'engine':<10} {'done':>5} {'out tok/s':>10} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    out = [header]
    for rate, engines in by_rate.items():
        for label, r in engines.items():
            vals = " ".join(f"{r[c]:>9.1f}" for c in COLUMNS[1:])
            out.append(f"{rate:>5} {label:<10} {r['completed']:>5} "
                       f"{r['output_throughput']:>10.1f} {vals}")
    return out


def ratios(by_rate: dict[str, dict[str, dict]]) -> list[str]:
    """kvflow throughput / peer throughput and peer latency / kvflow latency (> 1: kvflow
    better)."""
    out = []
    for rate, engines in by_rate.items():
        k = engines.get("kvflow")
        for label, r in engines.items():
            if k is None or label == "kvflow":
                continue
            out.append(f"rate {rate}: kvflow / {label}: output throughput "
                       f"{k['output_throughput'] / r['output_throughput']:.2f}x, "
                       f"p99 TTFT {r['p99_ttft_ms'] / k['p99_ttft_ms']:.2f}x, "
                       f"p99 TPOT {r['p99_tpot_ms'] / k['p99_tpot_ms']:.2f}x better")
    return out or ["no peer results: only kvflow ran (install a peer, see the script header)"]


def main(paths: list[str]) -> None:
    by_rate = load(paths)
    print("\n".join(rows(by_rate) + [""] + ratios(by_rate)))


if __name__ == "__main__":
    main(sys.argv[1:])
