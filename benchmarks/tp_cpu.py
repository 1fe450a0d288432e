"""CPU tensor parallelism: TP=2 (two worker processes, gloo) against TP=1 (one process) on
the same model and workload, alternating the two within one run, plus the share of each TP=2
step that the ranks spend inside collectives.

    .venv/bin/python benchmarks/tp_cpu.py --model Qwen2.5-Coder-0.5B-Instruct --repeats 3 \
        --variants 1,1t,2

Per engine and repeat it times one offline ``generate`` of ``--num-prompts`` random-token
prompts (``--input-len`` tokens, ``--output-len`` new tokens, greedy, EOS ignored) after a
warm-up request, and for TP=2 reads every rank's ``Worker.step_stats`` (seconds inside steps
and inside the TP all-reduces / all-gathers, waits for the other rank included). Prints one
JSON line per run and a summary with medians and the ratios to the first variant.

Variants: ``1`` = TP=1 with the engine's default threads (all usable cores), ``1t`` = TP=1
with ``cpu_threads=1`` (what each TP=2 rank gets on 2 cores), ``2`` = TP=2 (the engine splits
the cores between the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvflow import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="1,1t,2")
    return p.parse_args()


def run_once(args: argparse.Namespace, variant: str, prompts: list[list[int]]) -> dict:
    tp = int(variant.rstrip("t"))
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, tensor_parallel_size=tp,
              cpu_threads=1 if variant.endswith("t") else None,  # None: the engine's default
              kv_cache_memory="512MiB", max_model_len=args.input_len + args.output_len + 16)
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
        before = rank_stats(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = rank_stats(llm)
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    threads = torch.get_num_threads() if tp == 1 else "per rank: the engine's default split"
    row = {"variant": variant, "threads": threads, "startup_s": round(startup_s, 1),
           "elapsed_s": round(elapsed, 3), "output_tok_s": round(tokens / elapsed, 2),
           "first_tokens": outs[0].outputs[0].token_ids[:8]}
    if after:  # per rank: share of step time inside collectives
        shares = [(a["tp_comm_s"] - b["tp_comm_s"]) / max(a["step_s"] - b["step_s"], 1e-9)
                  for a, b in zip(after, before)]
        row["comm_share_per_rank"] = [round(x, 3) for x in shares]
        row["steps"] = after[0]["steps"] - before[0]["steps"]
        row["ms_per_step"] = round(1e3 * (after[0]["step_s"] - before[0]["step_s"]) /
                                   max(row["steps"], 1), 2)
    return row


def rank_stats(llm: LLM) -> list[dict] | None:
    """Every rank's ``Worker.step_stats`` (cumulative seconds and counts), None for one
    process (no ranks). Shared with cp_ring.py."""
    executor = llm.engine.core.executor
    return None if executor.config.parallel_config.world_size == 1 else \
        executor.collective_rpc("step_stats")


def alternate(args: argparse.Namespace, variants: list[str],
              run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``args.repeats`` rounds of ``run(variant)`` over ``variants`` in turn (so load changes
    hit all of them), after a JSON line of the load, CPU count and ``args``; each run's row
    printed as a JSON line. Returns the rows by variant. Shared with cp_ring.py."""
    print(json.dumps({"loadavg": os.getloadavg(), "cpus": os.cpu_count(), **vars(args)}))
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            row = run(variant)
            rows[variant].append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    variants = args.variants.split(",")
    rows = alternate(args, variants, lambda variant: run_once(args, variant, prompts))
    summary = {v: statistics.median(r["output_tok_s"] for r in rs) for v, rs in rows.items()}
    print(json.dumps({"median_output_tok_s": summary,
                      "ratio_vs_first": {v: round(x / summary[variants[0]], 3)
                                         for v, x in summary.items()},
                      "same_tokens": len({str(r["first_tokens"]) for rs in rows.values()
                                          for r in rs}) == 1}))


if __name__ == "__main__":
    main()
