"""Microseconds per call of the native LoRA kernel (``kernels/csrc/cpu_lora.c``) against the torch
grouped LoRA (``kvflow.lora.layers.grouped_lora``, one matmul pair per adapter) on SmolLM2-135M's
LoRA layer shapes at max rank 16 or ``--ranks`` (qkv 576->960 with 3 x rank rank rows, gate_up
576->3072 with 2 x rank, down 1536->576 with 1 x rank), bf16 activations (or ``--dtypes``),
fp32 slots, rows on one adapter or round-robin over four (``--mixes``). Each of B's two layouts: ``[max_loras, out, R]`` contiguous (``rows``: the kernel's
dot-product expand, the layout before session 50) and the transpose of a contiguous
``[max_loras, R, out]`` (``cols``: what :class:`kvflow.lora.layers.LoRALinear` keeps on CPU;
the kernel's vector expand), torch too in both. CPU time of the calling thread
(``time.thread_time``) with one torch thread, so other processes on a loaded machine change the
figures less than wall time; ``--rounds`` rounds of ``--calls`` calls, the candidates
alternating round by round (A, B, C, D, A, B, ...), the median round of each::

    .venv/bin/python benchmarks/lora_kernel.py [--batches 1,16,64] [--ranks 16] [--calls 100] [--rounds 7]
        [--dtypes bfloat16,float32] [--layouts rows,cols] [--mixes one,four]

(``--layouts cols`` times only the layout LoRALinear keeps.)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.lora.layers import grouped_lora, make_mapping

# (name, in, out, shards fused): the rank rows are shards x max rank
SHAPES = [("qkv", 576, 960, 3), ("gate_up", 576, 3072, 2), ("down", 1536, 576, 1)]


def median_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """The median over ``rounds`` rounds of ``calls`` calls of each of ``fns`` (alternating round
    by round), microseconds of thread CPU time per call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()
            for _ in range(calls):
                fn()
            times[name].append((time.thread_time() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ranks", default="16", help="max ranks per shard, comma-separated")
    p.add_argument("--dtypes", default="bfloat16", help="activation dtypes, comma-separated")
    p.add_argument("--layouts", default="rows,cols", help="B layouts, comma-separated")
    p.add_argument("--mixes", default="one,four", help="one adapter, four, or both")
    args = p.parse_args()
    kernels = native_cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels could not be built")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"ISA level {kernels.isa}; us per call, medians of {args.rounds} alternating rounds")
    layouts = args.layouts.split(",")
    mixes = [(mix, {"one": 1, "four": 4}[mix]) for mix in args.mixes.split(",")]
    for dtype, rows, max_rank, (name, inp, out, shards) in itertools.product(
            args.dtypes.split(","), map(int, args.batches.split(",")),
            map(int, args.ranks.split(",")), SHAPES):
        rank = shards * max_rank
        x = torch.randn(rows, inp, generator=gen).to(getattr(torch, dtype))
        y = torch.randn(rows, out, generator=gen).to(getattr(torch, dtype))
        a = torch.randn(4, rank, inp, generator=gen) * 0.01
        b_rows = torch.randn(4, out, rank, generator=gen) * 0.01
        b_cols = b_rows.transpose(1, 2).contiguous().transpose(1, 2)
        for mix, count in mixes:
            slots = np.arange(rows) % count
            row_slots = torch.from_numpy(slots.astype(np.int32))
            mapping = make_mapping(slots, torch.device("cpu"))
            b = {"rows": b_rows, "cols": b_cols}
            fns = {}
            for layout in layouts:
                fns[f"native {layout}"] = partial(kernels.lora, y, x, a, b[layout], row_slots)
                fns[f"torch {layout}"] = partial(grouped_lora, y, x, a, b[layout], mapping)
            us = median_us(fns, args.calls, args.rounds)
            print(f"{dtype}, {rows} rows, rank {max_rank}, {name}, {mix}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in us.items()) + "; native/torch " + ", ".join(
                f"{layout} {us[f'native {layout}'] / us[f'torch {layout}']:.2f}"
                for layout in layouts), flush=True)


if __name__ == "__main__":
    main()
