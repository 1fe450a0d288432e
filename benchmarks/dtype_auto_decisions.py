"""``--dtype auto``'s decision on this CPU, again and again: how often each dtype is picked, by
what margin, and what the timing costs, with no model loaded (the decision alone).

Each run is a fresh process with a fresh ``KVFLOW_CACHE_DIR`` (a link to the compiled kernels
only) and ``PYTHONPATH`` at one of ``--trees``; it runs ``gemm_select.measure_cpu_dtype`` for
the model's HF config with bf16 as the engine does (prefill rows 2,048, ``--max-num-seqs``
256, CPU step graphs expected) and prints one JSON line: the dtype picked, each dtype's step
time relative to the faster per row class and their sums (``choose_dtype`` picks the lower
sum), and the CPU seconds the decision took (``time.process_time``). Trees alternate run by
run. ``--rows64-from-memory`` makes the 64-row class cycle through the whole one-row pool
(weights read from memory, as a decode step of a model larger than the cache reads them)
instead of two copies (``gemm_timing.pass_copies`` patched), to see whether that changes the
decision.

    PYTHONPATH=. .venv/bin/python benchmarks/dtype_auto_decisions.py out/smollm2-hf \\
        --trees /tmp/base . --rounds 6
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from transformers import AutoConfig
from kvflow.kernels import gemm_select, gemm_timing
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.platforms.cpu import CpuPlatform

native_cpu_kernels()  # built or loaded before the clock starts
if sys.argv[2] == "1":
    copies = gemm_timing.pass_copies
    gemm_timing.pass_copies = lambda rows, pool: pool if rows <= 64 else copies(rows, pool)
steps = {}
estimate = gemm_select.estimated_step_seconds
def estimated(shapes, dtype, *args, **kwargs):
    steps[str(dtype).removeprefix("torch.")] = estimate(shapes, dtype, *args, **kwargs)
    return steps[str(dtype).removeprefix("torch.")]
gemm_select.estimated_step_seconds = estimated
cfg = AutoConfig.from_pretrained(sys.argv[1])
start = time.process_time()
dtype = gemm_select.measure_cpu_dtype(cfg, torch.bfloat16, "auto",
                                      CpuPlatform().prepacks_gemm_weights, (1, 64, 2048), 256,
                                      True)
cpu_s = time.process_time() - start
rel = {d: {r: round(s / min(t[r] for t in steps.values()), 3) for r, s in st.items()}
       for d, st in steps.items()}
print(json.dumps({"dtype": str(dtype).removeprefix("torch."), "cpu_s": round(cpu_s, 3),
                  "relative": rel, "sums": {d: round(sum(v.values()), 3) for d, v in rel.items()}}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--trees", nargs="+", default=["."], help="kvflow source trees")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--rows64-from-memory", action="store_true",
                   help="time the 64-row class on the whole one-row pool (weights from memory)")
    return p.parse_args(argv)


def fresh_cache_dir() -> str:
    """A temporary cache dir holding only a link to the compiled kernels (as
    ``dtype_auto_startup.py``'s)."""
    path = tempfile.mkdtemp(prefix="kvflow-dtype-decision-")
    kernels = Path(os.path.expanduser("~/.cache/kvflow/kernels"))
    if kernels.is_dir():
        os.symlink(kernels, os.path.join(path, "kernels"))
    return path


def run_once(tree: str, model: str, from_memory: bool) -> dict:
    """One decision in a fresh process; its JSON line, with the load average at its start."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "KVFLOW_CACHE_DIR": fresh_cache_dir(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(model),
                          "1" if from_memory else "0"],
                         cwd=tree, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return {"tree": tree, "load": round(load, 1), **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = []
    for rnd in range(args.rounds):
        for tree in args.trees if rnd % 2 == 0 else args.trees[::-1]:
            row = run_once(tree, args.model_dir, args.rows64_from_memory)
            results.append(row)
            print(json.dumps(row), flush=True)
    print("\nper tree: dtypes picked, decision CPU s (min-max), sums bf16 / fp32 (min-max)")
    for tree in args.trees:
        rows = [r for r in results if r["tree"] == tree]
        picked = collections.Counter(r["dtype"] for r in rows)
        cpu = [r["cpu_s"] for r in rows]
        sums = {d: [r["sums"][d] for r in rows] for d in ("bfloat16", "float32")}
        print(f"{tree}: {dict(picked)}; {min(cpu):.2f}-{max(cpu):.2f} CPU s; " + ", ".join(
            f"{d} {min(v):.2f}-{max(v):.2f}" for d, v in sums.items()))


if __name__ == "__main__":
    main()
