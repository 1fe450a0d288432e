"""Where served p99 TTFT comes from at 4 req/s on a slow CPU, by the scheduling rule alone:
kvflow's own ``Scheduler`` on the fake clock (``tests/core/sim.py``), no model, fed
``compare_cpu.sh``'s workload (64 x 128 -> 64, EOS ignored) at the send times ``kvflow bench
serve --seed S`` draws (``kvflow.bench.datasets.arrival_intervals``), each step lasting
``a + b * prefill tokens + c * decode rows`` seconds. The default coefficients (50 ms, 1.1 ms
per prefill token, 0.2 ms per decode row) are the grid fit to the per-request TTFTs and the
median TPOT of session 52's served kvflow bf16 run on the 2-vCPU Ice Lake Xeon
(docs/benchmarks.md, "2026-12-07 session 53: served p99 TTFT"); the fit reproduces its TTFT
p50 / p99 and TPOT p50 within 10%.

For each ``--max-num-batched-tokens`` value it prints, over ``--seeds`` arrival draws, the
median of each run's TTFT p50 / p99, TPOT p99 and output tok/s, and for the slowest 5% of
requests the steps that ran between a request's arrival and its first token (its wait for the
step in progress plus the steps before and with its prefill) and the prefill tokens of the
step that gave its first token. ``--threshold N`` and ``--async-scheduling`` run every
budget with that option. ``--detail SEED`` prints the slowest requests of that seed step
by step (what each step carried, its duration). Deterministic, a few seconds, no lock needed:
it measures the rule, not the machine (the timings are compare_cpu.sh's).

    .venv/bin/python benchmarks/ttft_tail_sim.py
    .venv/bin/python benchmarks/ttft_tail_sim.py --budgets 2048 --threshold 64
    .venv/bin/python benchmarks/ttft_tail_sim.py --budgets 2048 --prefill-ms 1.1,1.0,0.9,0.8
    .venv/bin/python benchmarks/ttft_tail_sim.py --budgets 2048 --seeds 1 --first-seed 1 --detail 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvflow.bench.datasets import arrival_intervals
from kvflow.core.step_time_model import StepFeatures
from tests.core.sim import FakeClock, SimRequest, SimResult, make_sim_scheduler, simulate


@dataclass
class Step:
    """One simulated step: start and end (s), prefill tokens, decode rows."""

    start: float
    end: float
    prefill: int
    decodes: int


def run_once(arrivals: list[float], budget: int, a: float, b: float, c: float,
             input_len: int, output_len: int, **config) -> tuple[SimResult, list[Step]]:
    """One workload through the scheduler; returns the result and its steps."""
    clock = FakeClock()
    steps: list[Step] = []

    def step_time(f: StepFeatures) -> float:
        duration = a + b * f.prefill_tokens + c * f.decode_requests
        steps.append(Step(clock.now, clock.now + duration, f.prefill_tokens, f.decode_requests))
        return duration

    scheduler = make_sim_scheduler(clock, max_num_batched_tokens=budget, **config)
    # client = request id: tokens_by_client then lists each request's tokens per step
    workload = [SimRequest(f"r{i:03d}", t, input_len, output_len, client=f"r{i:03d}")
                for i, t in enumerate(arrivals)]
    return simulate(workload, clock, scheduler, step_time), steps


def slowest(result: SimResult, fraction: float = 0.05) -> list[str]:
    """Ids of the ``fraction`` of requests with the longest TTFT (at least one), slowest
    first."""
    order = sorted(result.timelines, key=lambda rid: -result.timelines[rid].ttft)
    return order[:max(1, round(fraction * len(order)))]


def tail_steps(result: SimResult, steps: list[Step], rid: str) -> list[Step]:
    """The steps that ran while request ``rid`` waited for its first token: the one in
    progress at its arrival, then every step up to the one that gave its first token."""
    tl = result.timelines[rid]
    return [s for s in steps if s.end > tl.arrival + 1e-12 and s.end <= tl.first_token + 1e-12]


def summary(arrival_sets: list[list[float]], budget: int, a: float, b: float, c: float,
            input_len: int, output_len: int, **config) -> dict[str, float]:
    """Medians over the arrival sets of each run's figures (``config``: more
    SchedulerConfig fields)."""
    rows = []
    for arrivals in arrival_sets:
        result, steps = run_once(arrivals, budget, a, b, c, input_len, output_len, **config)
        ttft = np.array([t.ttft for t in result.timelines.values()]) * 1e3
        tpot = np.array([t.tpot for t in result.timelines.values()]) * 1e3
        tail = slowest(result)
        waits = [tail_steps(result, steps, rid) for rid in tail]
        rows.append({"ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
                     "tpot_p99": np.percentile(tpot, 99), "tok_s": result.output_throughput(),
                     "tail_steps": statistics.mean(len(w) for w in waits),
                     "tail_prefill": statistics.mean(w[-1].prefill for w in waits)})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def detail(arrivals: list[float], budget: int, a: float, b: float, c: float,
           input_len: int, output_len: int) -> None:
    """The slowest 5% of one run, step by step."""
    result, steps = run_once(arrivals, budget, a, b, c, input_len, output_len)
    for rid in slowest(result):
        tl = result.timelines[rid]
        chunks = [n for t, n in result.tokens_by_client[rid] if t <= tl.first_token + 1e-12]
        print(f"{rid}: arrival {tl.arrival:.3f} s, TTFT {tl.ttft * 1e3:.0f} ms, prefill "
              f"chunks {chunks}")
        for s in tail_steps(result, steps, rid):
            print(f"    step {s.start:7.3f}-{s.end:7.3f} s ({(s.end - s.start) * 1e3:4.0f} ms): "
                  f"{s.decodes:3d} decode rows + {s.prefill:5d} prefill tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="2048,1024,512,256",
                   help="--max-num-batched-tokens values to compare")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seeds", type=int, default=20, help="arrival draws (seeds)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--fixed-ms", type=float, default=50.0, help="a: ms per step")
    p.add_argument("--prefill-ms", default="1.1", help="b: ms per prefill token (a list "
                   "compares prefill speeds)")
    p.add_argument("--decode-ms", type=float, default=0.2, help="c: ms per decode row")
    p.add_argument("--threshold", type=int, default=0,
                   help="--long-prefill-token-threshold (0: none, the default)")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--detail", type=int, default=None, metavar="SEED",
                   help="print the slowest 5%% of this seed's run step by step")
    args = p.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    arrival_sets = [list(np.cumsum(arrival_intervals(args.num_prompts, args.rate, 1.0, s)))
                    for s in seeds]
    a, c = args.fixed_ms / 1e3, args.decode_ms / 1e3
    budgets = [int(x) for x in args.budgets.split(",")]
    config = {"long_prefill_token_threshold": args.threshold,
              "async_scheduling": args.async_scheduling}
    print(f"{args.num_prompts} x {args.input_len} -> {args.output_len} at {args.rate:g} req/s, "
          f"seeds {seeds.start}-{seeds.stop - 1}; step = {args.fixed_ms:g} ms + b * prefill "
          f"tokens + {args.decode_ms:g} ms * decode rows; threshold {args.threshold}, async "
          f"scheduling {'on' if args.async_scheduling else 'off'}; medians over the seeds\n")
    print("| b (ms/token) | budget | TTFT p50 | TTFT p99 | TPOT p99 (ms) | out tok/s "
          "| slowest 5%: steps waited | prefill tokens of its first-token step |")
    print("|---|---|---|---|---|---|---|---|")
    for b_ms in (float(x) for x in args.prefill_ms.split(",")):
        for budget in budgets:
            s = summary(arrival_sets, budget, a, b_ms / 1e3, c, args.input_len,
                        args.output_len, **config)
            print(f"| {b_ms:g} | {budget} | {s['ttft_p50']:.0f} | {s['ttft_p99']:.0f} | "
                  f"{s['tpot_p99']:.0f} | {s['tok_s']:.1f} | {s['tail_steps']:.1f} | "
                  f"{s['tail_prefill']:.0f} |")
    if args.detail is not None:
        arrivals = list(np.cumsum(arrival_intervals(args.num_prompts, args.rate, 1.0,
                                                    args.detail)))
        for budget in budgets:
            print(f"\nseed {args.detail}, budget {budget}, b {args.prefill_ms.split(',')[0]} "
                  "ms/token: the slowest 5%")
            detail(arrivals, budget, a, float(args.prefill_ms.split(",")[0]) / 1e3, c,
                   args.input_len, args.output_len)


if __name__ == "__main__":
    main()
