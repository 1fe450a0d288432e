"""``--cpu-gemm`` choices against CPU step graphs: decode throughput and replayed steps.

Each round starts one process per (tree, ``--cpu-gemm`` value), in turn (the order flips every
round, so every configuration sees the same machine load on average). A process loads the
model (prefix caching off, as ``offline_engine.py``), warms up, generates
``--num-prompts`` of CPU-W1's random-token prompts (128 tokens) -> ``--output-len`` greedy
tokens (EOS ignored) three times and reports the median output tok/s, the decode steps its
CPU step graph replayed (``graph_runner.replayed_steps``; 0: every decode step ran eagerly)
and how many GEMM modules each kernel got.

Every process reads and writes ``--cpu-gemm auto``'s timings under one cache dir
(``KVFLOW_CACHE_DIR=--cache-dir``, default a fresh temp dir): the first ``auto`` process
measures them, every later one (either tree) reuses them, so two trees choose from the same
timings and differ only in how they choose. A choice ``X:eager`` runs ``--cpu-gemm X`` with
``--enforce-eager`` (no step graph: what a replayed step saves)::

    .venv/bin/python benchmarks/gemm_choice_graphs.py out/smollm2-hf --dtype float32 \\
        --choices native,onednn,auto --trees /tmp/base . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--choices", default="native,onednn,auto",
                   help="--cpu-gemm values (X:eager adds --enforce-eager)")
    p.add_argument("--trees", nargs="+", default=["."], help="kvflow source trees")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--cache-dir", default=None, help="KVFLOW_CACHE_DIR (default: a temp dir)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def kernel_counts(model) -> dict[str, int]:
    """GEMM modules of ``model`` per packed-weight class (NativePackedWeight, ...)."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            small = getattr(packed, "small", None)
            name = type(packed).__name__ if small is None else \
                f"{type(small).__name__}<={packed.max_small_rows}/{type(packed.large).__name__}"
            counts[name] += 1
    return dict(counts)


def measure(args: argparse.Namespace) -> dict:
    """One process's figures (``--child`` = the ``--cpu-gemm`` value)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    choice, _, eager = args.child.partition(":")
    llm, params_cls, _ = offline_engine.load_engine("kvflow", args.model_dir, args.dtype,
                                                    cpu_gemm=choice,
                                                    enforce_eager=eager == "eager")
    ids = offline_engine.cpu_w1_token_ids(llm.get_tokenizer().vocab_size, args.num_prompts)
    offline_engine.greedy_run(llm, params_cls, ids[:2], 4)  # warm-up
    tok_s = statistics.median(
        args.num_prompts * args.output_len
        / offline_engine.greedy_run(llm, params_cls, ids, args.output_len)[0]
        for _ in range(3))
    runner = llm.engine.core.executor.runner
    return {"tok_s": tok_s,
            "replayed": getattr(runner.graph_runner, "replayed_steps", 0),
            "kernels": kernel_counts(runner.model)}


def compare(args: argparse.Namespace) -> None:
    cache = args.cache_dir or tempfile.mkdtemp(prefix="kvflow-gemm-choice-")
    configs = [(tree, choice) for tree in args.trees for choice in args.choices.split(",")]
    runs: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for tree, choice in configs if rnd % 2 == 0 else configs[::-1]:
            env = dict(os.environ, KVFLOW_CACHE_DIR=cache, PYTHONPATH=os.path.abspath(tree))
            cmd = [sys.executable, os.path.abspath(__file__), args.model_dir, "--dtype",
                   args.dtype, "--num-prompts", str(args.num_prompts), "--output-len",
                   str(args.output_len), "--child", choice]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            runs[(tree, choice)].append(figures["tok_s"])
            print(f"round {rnd} {tree} {choice}: {figures['tok_s']:.1f} tok/s, replayed "
                  f"{figures['replayed']}, {figures['kernels']}", flush=True)
    base = statistics.median(runs[configs[0]])
    for (tree, choice), values in runs.items():
        median = statistics.median(values)
        print(f"{tree} {choice}: median {median:.1f} tok/s ({median / base:.3f}x "
              f"{configs[0][0]} {configs[0][1]})")
    print(f"timings cache: {cache}")


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(measure(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
