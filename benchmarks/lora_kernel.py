"""Microseconds per call of the native LoRA kernel (``kernels/csrc/cpu_lora.c``) against the torch
grouped LoRA (``kvflow.lora.layers.grouped_lora``, one matmul pair per adapter) on SmolLM2-135M's
LoRA layer shapes at max rank 16 (qkv 576->960 with 48 rank rows, gate_up 576->3072 with 32,
down 1536->576 with 16), bf16 activations, fp32 slots, rows on one adapter or round-robin over
four. CPU time of the calling thread (``time.thread_time``) with one torch thread, so other
processes on a loaded machine change the figures less than wall time; the best of 5 rounds of
``--calls`` calls::

    .venv/bin/python benchmarks/lora_kernel.py [--batches 1,16,64] [--calls 100]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.lora.layers import grouped_lora, make_mapping

SHAPES = [("qkv", 576, 960, 48), ("gate_up", 576, 3072, 32), ("down", 1536, 576, 16)]


def best_us(fn, calls: int) -> float:
    """The best of 5 rounds of ``calls`` calls of ``fn``, microseconds of thread CPU time each."""
    fn()
    rounds = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        rounds.append((time.thread_time() - start) / calls * 1e6)
    return min(rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    kernels = native_cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels could not be built")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for rows in (int(b) for b in args.batches.split(",")):
        for name, inp, out, rank in SHAPES:
            x = torch.randn(rows, inp, generator=gen).bfloat16()
            y = torch.randn(rows, out, generator=gen).bfloat16()
            a = torch.randn(4, rank, inp, generator=gen) * 0.01
            b = torch.randn(4, out, rank, generator=gen) * 0.01
            for mix, count in (("one", 1), ("four", 4)):
                slots = np.arange(rows) % count
                native = best_us(partial(kernels.lora, y, x, a, b,
                                         torch.from_numpy(slots.astype(np.int32))), args.calls)
                torch_us = best_us(partial(grouped_lora, y, x, a, b,
                                           make_mapping(slots, torch.device("cpu"))), args.calls)
                print(f"{rows} rows, {name}, {mix}: native {native:.1f} us, torch "
                      f"{torch_us:.1f} us, native / torch {native / torch_us:.2f}", flush=True)


if __name__ == "__main__":
    main()
