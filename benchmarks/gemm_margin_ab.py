"""``--cpu-gemm auto``'s step-graph margin end to end, on one compute thread by CPU time.

One process: an fp32 engine (``--cpu-gemm auto``, prefix caching off, ``cpu_threads=1``), the
kernels its choice gave the GEMM modules and the decode steps its CPU step graph replayed,
batch-1 decode CPU ms per step (128-token prompt, (t(65 tokens) - t(1)) / 64, three times) and
CPU-W1's process CPU seconds (64 x 128 random-token prompts -> 64 greedy tokens, EOS ignored)::

    PYTHONPATH=<tree> .venv/bin/python benchmarks/gemm_margin_ab.py out/smollm2-hf \\
        [--seed-timings FILE] [--enforce-eager] [--label NAME]

``--seed-timings``: a ``cpu_gemm/*.json`` GEMM timings file whose ``float32|...`` entries the
choice reads instead of timing (an empty cache dir under ``--cache-dir`` is seeded; prefill
calls there were timed on the full weight width, so slices are off in this process), so two
trees (``PYTHONPATH``, alternating processes) choose from the same times and differ only in
their rule. Without it the tree's timings cache is used (measured on the first start).
``--enforce-eager``: no step graph (what replay saves: the step time against a run without).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--seed-timings", default=None)
    p.add_argument("--cache-dir", default="/tmp/kvflow_gemm_margin_ab",
                   help="KVFLOW_CACHE_DIR with --seed-timings (its cpu_gemm/ is replaced)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--label", default="run")
    p.add_argument("--prefill-rows", type=int, default=2048,
                   help="the engine's prefill row class (its max_num_batched_tokens)")
    return p.parse_args(argv)


def seed(args: argparse.Namespace) -> None:
    """Point the cache at ``--cache-dir`` and write the seeded timings where this process's
    engine will read them (the file named by :func:`gemm_timings` on one thread)."""
    os.environ["KVFLOW_CACHE_DIR"] = args.cache_dir
    shutil.rmtree(Path(args.cache_dir) / "cpu_gemm", ignore_errors=True)
    from kvflow.kernels import (  # kvflow before torch: its OpenMP settings apply
        gemm_timing,
        gemm_timing_cache,
    )
    from kvflow.kernels.cpu_native import native_cpu_kernels

    torch = sys.modules["torch"]  # imported by kvflow's kernels, after kvflow's settings

    gemm_timing.COMPUTE_N = 1 << 30  # the seeded prefill times are the full width's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = gemm_timing_cache.gemm_timings(native_cpu_kernels(), (1, 64, args.prefill_rows)).path
    torch.set_num_threads(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    seconds = json.loads(Path(args.seed_timings).read_text())
    path.write_text(json.dumps({k: v for k, v in seconds.items() if k.startswith("float32|")}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.seed_timings:
        seed(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from offline_engine import cpu_w1_token_ids

    import kvflow
    from kvflow import LLM, SamplingParams

    llm = LLM(model=args.model_dir, dtype="float32", enable_prefix_caching=False,
              kv_cache_memory="1GiB", cpu_threads=1, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=args.prefill_rows)
    runner = llm.engine.core.executor.runner
    kernels = Counter(type(m.packed_weight).__name__ for m in runner.model.modules()
                      if getattr(m, "packed_weight", None) is not None)

    def cpu_seconds(prompts: list, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        return time.process_time() - start

    prompt = [list(range(100, 228))]
    cpu_seconds(prompt, 33)  # warm-up, records the batch-1 step graph
    b1 = [(cpu_seconds(prompt, 65) - cpu_seconds(prompt, 1)) / 64 * 1e3 for _ in range(3)]
    w1 = cpu_seconds(cpu_w1_token_ids(llm.get_tokenizer().vocab_size), 64)
    replayed = getattr(runner.graph_runner, "replayed_steps", 0)
    print(f"{args.label} ({os.path.dirname(kvflow.__file__)}): kernels {dict(kernels)}, "
          f"replayed {replayed}; b1 decode CPU ms/step {', '.join(f'{x:.2f}' for x in b1)} "
          f"(median {statistics.median(b1):.2f}); CPU-W1 {w1:.2f} CPU-s")


if __name__ == "__main__":
    main()
