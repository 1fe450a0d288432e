"""GFLOP/s of the CPU GEMM kernels on SmolLM2-135M's GEMM shapes, one thread, by CPU time.

    .venv/bin/python benchmarks/cpu_gemm_kernels.py [--threads 1] [--levels avx512_bf16,avx2]

For each weight shape and row count: kvflow's C GEMM built for each ISA level this CPU runs
(``KVFLOW_CPU_ISA`` levels; fp32 weights, and bf16 weights - VDPBF16PS pairs on AVX512-BF16,
widened to fp32 elsewhere) and oneDNN's packed GEMM in fp32 and bf16. Each figure is the best
of 5 passes of process CPU time per call (less sensitive to other processes on a shared machine
than wall time; the weight stays in cache, so one-row calls show compute, not memory).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvflow.kernels.cpu_build import isa_levels_for_cpu
from kvflow.kernels.cpu_native import native_cpu_kernels_for_isa

SHAPES = [(3072, 576), (576, 1536), (8192, 576)]  # gate_up, down, a slice of the LM head
ROWS = (1, 16, 64, 256)


def cpu_seconds(fn, reps: int) -> float:
    """Best of 5 passes of ``reps`` calls, process CPU time per call."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - start) / reps)
    return best


def kernels_of(n: int, k: int, m: int, levels) -> dict[str, float]:
    """Seconds per call of every kernel on an [n, k] weight and m rows."""
    res = {}
    reps = max(3, 2000 // (m * 8))
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k).to(dt)
        for name, kern in levels.items():
            packed = kern.gemm_pack(w)
            x = torch.randn(m, k).to(kern.gemm_x_dtype(dt))
            res[f"{name}/{str(dt)[6:]}"] = cpu_seconds(
                lambda kern=kern, x=x, packed=packed: kern.gemm(x, packed, n), reps)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        x = torch.randn(m, k).to(dt)
        res[f"onednn/{str(dt)[6:]}"] = cpu_seconds(
            lambda x=x, onednn=onednn: torch.ops.mkldnn._linear_pointwise(
                x, onednn, None, "none", [], ""), reps)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--levels", default=",".join(lv.name for lv in isa_levels_for_cpu()[:2]))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = {name: native_cpu_kernels_for_isa(name) for name in args.levels.split(",")}
    levels = {name: k for name, k in levels.items() if k is not None}
    for n, k in SHAPES:
        for m in ROWS:
            res = kernels_of(n, k, m, levels)
            flops = 2 * m * n * k
            print(f"{n}x{k} m={m}: " + ", ".join(f"{a} {flops / s / 1e9:.0f}"
                                                  for a, s in res.items()) + " GFLOP/s")


if __name__ == "__main__":
    main()
