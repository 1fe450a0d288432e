"""Goodput of SLA mode (TTFT/TPOT targets + admission control) vs the fixed token budget on the
fake clock: the scheduler itself, no model, a CPU-like step time with +-30% noise per step
(tests/core/test_slo_feedback.py: 40 ms fixed, 0.25 ms per prefill token, 1 ms per decode,
0.2 us per attended key). Poisson arrivals, prompts of 64-256 tokens, 32-96 output tokens,
the same arrivals and noise for both; a request is good when its TTFT <= ``--ttft-ms`` and its
mean TPOT <= ``--tpot-ms`` (a rejected one is not). Deterministic (seeded), a few seconds, no
lock needed: it measures the scheduling rule, not the machine (benchmarks/slo_goodput.py does
that with two real servers).

    .venv/bin/python benchmarks/slo_goodput_sim.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.core.test_slo_feedback import (
    admission_by_verdict,
    noisy30,
    poisson,
    run,
)


def good_count(result, ids, ttft_s: float, tpot_s: float) -> int:
    return sum(1 for rid in ids if result.timelines[rid].ttft <= ttft_s
               and (result.timelines[rid].tpot or 0) <= tpot_s)


def one(rate: float, seed: int, n: int, ttft_ms: float, tpot_ms: float) -> dict:
    """Both schedulers on one seeded workload: good requests, rejections, output tok/s."""
    slo = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}
    decisions: dict[str, bool] = {}
    sla = run(poisson(rate, n, seed=seed, **slo), noisy30(seed),
              admission=admission_by_verdict(record=decisions),
              target_ttft_ms=ttft_ms, target_tpot_ms=tpot_ms)
    fixed = run(poisson(rate, n, seed=seed), noisy30(seed), warmed=False)
    accepted = [rid for rid, ok in decisions.items() if ok]
    s = (ttft_ms / 1e3, tpot_ms / 1e3)
    return {"fixed_good": good_count(fixed, fixed.timelines, *s),
            "sla_good": good_count(sla, accepted, *s), "rejected": n - len(accepted),
            "fixed_tok_s": fixed.output_throughput(), "sla_tok_s": sla.output_throughput()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="2,4,6,8,12", help="arrivals per second")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=80.0)
    args = p.parse_args()
    n = args.num_requests
    print(f"| rate (req/s) | fixed good / {n} | SLA good / {n} | SLA rejected | goodput ratio "
          "| fixed out tok/s | SLA out tok/s |")
    print("|---|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        runs = [one(rate, seed, n, args.ttft_ms, args.tpot_ms) for seed in range(args.seeds)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = med["sla_good"] / max(med["fixed_good"], 1)
        print(f"| {rate:g} | {med['fixed_good']:g} | {med['sla_good']:g} | "
              f"{med['rejected']:g} | {ratio:.2f}{'' if med['fixed_good'] else ' (fixed 0)'} "
              f"| {med['fixed_tok_s']:.0f} | {med['sla_tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
