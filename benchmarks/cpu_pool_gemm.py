"""kvflow's C GEMM on SmolLM2-135M's decode and prefill shapes, quiet and beside one busy-looping
process: OpenMP threads vs kvflow's pool (``--cpu-gemm-pool``) vs one thread.

    python benchmarks/cpu_pool_gemm.py [--bind] [--rounds 3] [--reps 10]

Per pass, fp32, random weights: one SmolLM2 layer's four products at a batch of 32 decodes
(qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576), the LM head
576 -> 49152 at batch 32, and gate_up for a 512-row prefill chunk. Modes alternate within
each round; the figure is the median ms per pass over rounds. ``--bind`` pins the OpenMP
threads and the pool's worker to CPUs 0 and 1.
"""

from __future__ import annotations  # noqa: I001 (kvflow before torch: its OpenMP settings)

import argparse
import statistics
import subprocess
import sys
import time

import kvflow  # noqa: F401
import torch
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_pool import CpuPool

SHAPES = [(32, 960, 576), (32, 576, 576), (32, 3072, 576), (32, 576, 1536), (32, 49152, 576),
          (512, 3072, 576)]  # (rows, n, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    kernels = native_cpu_kernels()
    torch.set_num_threads(2)
    if args.bind:
        kernels.bind_threads([0, 1])
    gen = torch.Generator().manual_seed(0)
    work = [(kernels.gemm_pack(torch.randn(n, k, generator=gen)), n,
             torch.randn(m, k, generator=gen)) for m, n, k in SHAPES]
    pool = CpuPool(kernels, 1, [1] if args.bind else None)

    def one_pass(mode: str) -> float:
        torch.set_num_threads(1 if mode == "1 thread" else 2)
        kernels.pool = pool if mode == "pool" else None
        start = time.perf_counter()
        for _ in range(args.reps):
            for packed, n, x in work:
                kernels.gemm(x, packed, n)
        return (time.perf_counter() - start) / args.reps * 1e3

    modes = ("openmp", "pool", "1 thread")
    results = {}
    for label in ("quiet", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
            if label == "busy" else None
        try:
            time.sleep(0.3)
            times = {m: [] for m in modes}
            for _ in range(args.rounds):
                for m in modes:
                    times[m].append(one_pass(m))
            results[label] = {m: statistics.median(v) for m, v in times.items()}
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    kernels.pool = None
    print(f"ms per pass (median of {args.rounds}), bind={args.bind}")
    print("| mode | quiet | beside busy loop | busy / quiet |")
    print("|---|---|---|---|")
    for m in modes:
        q, b = results["quiet"][m], results["busy"][m]
        print(f"| {m} | {q:.1f} | {b:.1f} | {b / q:.2f}x |")
    print(f"pool items: {pool.stats()}")
    pool.close()


if __name__ == "__main__":
    main()
