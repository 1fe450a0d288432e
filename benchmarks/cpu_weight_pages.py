"""A decode step's weight stream on 4 KB pages against huge pages (issue 23).

    .venv/bin/python benchmarks/cpu_weight_pages.py [--rows 1,8] [--passes 7] [--rounds 5]
        [--dtype bfloat16] [--threads 1]

Packs SmolLM2-135M's GEMM weights for kvflow's C GEMM twice: each weight in a tensor of its
own (torch's allocator: 4 KB pages for the many weights under 2 MB), and all of them side by
side in a :class:`kvflow.platforms.cpu_memory.HugePageArena` (transparent huge pages). One
"sweep" multiplies ``rows`` activation rows by every weight in model order (30 layers of
qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], then the LM head
[49152, 576]: 269 MB in bf16, far larger than the last-level cache), as a decode step's GEMMs
do. Per round the two layouts alternate, each the best of ``--passes`` sweeps; with one thread
by process CPU time (little disturbed by other processes), with more by wall time. Prints per
row count the median over rounds of ms per sweep and GB/s of weights, and the ratio
4 KB / huge (> 1: huge pages faster). The THP mode (/sys/kernel/mm/transparent_hugepage/enabled)
and the bytes the arena had advised are printed with the figures: with ``never`` both layouts
are on 4 KB pages.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.platforms.cpu_memory import HugePageArena

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def pack_all(kernels, weights: list[torch.Tensor], arena: HugePageArena | None) -> list:
    """Packed copies of ``weights`` (in ``arena`` when given)."""
    out = []
    for w in weights:
        dest = None if arena is None else arena.empty(
            kernels.gemm_packed_numel(*w.shape, w.dtype), w.dtype)
        out.append(kernels.gemm_pack(w, dest))
    return out


def sweep_seconds(kernels, packed: list, shapes: list, x: dict, passes: int,
                  cpu_time: bool) -> float:
    """Best of ``passes`` sweeps over every packed weight, seconds."""
    clock = time.process_time if cpu_time else time.perf_counter
    best = float("inf")
    for _ in range(passes):
        start = clock()
        for p, (n, k) in zip(packed, shapes, strict=True):
            kernels.gemm(x[k], p, n)
        best = min(best, clock() - start)
    return best


def thp_mode() -> str:
    """The bracketed THP mode, or 'unknown'."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native_cpu_kernels()
    if kernels is None:
        raise SystemExit("kvflow's native CPU kernels are not available here")
    dtype = getattr(torch, args.dtype)
    shapes = LAYER_SHAPES * LAYERS + [HEAD]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
    arena = HugePageArena()
    layouts = {"4 KB": pack_all(kernels, weights, None), "huge": pack_all(kernels, weights, arena)}
    del weights
    nbytes = sum(p.numel() * p.element_size() for p in layouts["huge"])
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines
                if line.startswith("model name")), "?")
    print(f"{cpu}; {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time; "
          f"THP {thp_mode()}; arena advised {arena.advised_bytes / 2**20:.0f} MiB of "
          f"{nbytes / 2**20:.0f} MiB; load {os.getloadavg()}")
    print("| rows | 4 KB ms/sweep (GB/s) | huge ms/sweep (GB/s) | 4 KB / huge |")
    print("|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(m, k, generator=gen).to(kernels.gemm_x_dtype(dtype))
             for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.rounds):
            for name, packed in layouts.items():
                times[name].append(sweep_seconds(kernels, packed, shapes, x, args.passes,
                                                 args.threads == 1))
        small, huge = (statistics.median(times[n]) for n in ("4 KB", "huge"))
        print(f"| {m} | {small * 1e3:.2f} ({nbytes / small / 1e9:.1f}) | "
              f"{huge * 1e3:.2f} ({nbytes / huge / 1e9:.1f}) | {small / huge:.2f}x |",
              flush=True)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
