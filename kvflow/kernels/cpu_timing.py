"""Timing candidate kernels against each other on a shared CPU, and caching the timings: the
rule and the cache the per-CPU kernel choices (LoRA's :mod:`kvflow.lora.cpu_kernel_choice`, prefill attention's
:mod:`kvflow.attention.prefill_select`) time their candidates by.

Each call runs on one torch thread and counts the process's CPU time, which other processes
on a shared machine change least; the candidates' passes alternate (A, B, A, B, ...) so that
neither wins by running in a quieter moment; the minimum pass is kept (the reasons are
:func:`kvflow.kernels.gemm_timing.time_candidates`', whose GEMM timing adds weight pools).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.timings_file import read_timings, write_timings

Calls = dict[str, Callable[[], object]]


def alternating_cpu_seconds(make_calls: Callable[[], Calls], repeats: int,
                            per_pass: int = 1) -> dict[str, float]:
    """CPU seconds per call of each candidate that ``make_calls()`` builds (name -> a call
    with its operands bound), on one torch thread: one warm-up call each, then the minimum
    over ``repeats`` passes of ``per_pass`` calls, the candidates' passes alternating. A pass
    faster than the clock's tick reads 0 and counts as 1e-9 s. torch's thread count is
    restored afterwards, also when a call raises (which propagates)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = make_calls()
        with torch.inference_mode():
            for call in calls.values():
                call()
            best = dict.fromkeys(calls, math.inf)
            for _ in range(repeats):
                for name, call in calls.items():
                    start = time.process_time()
                    for _ in range(per_pass):
                        call()
                    best[name] = min(best[name], (time.process_time() - start) / per_pass)
        return {name: max(s, 1e-9) for name, s in best.items()}
    finally:
        torch.set_num_threads(threads)


class CachedTimings:
    """Seconds per call by (shape, candidate, class) of a per-CPU kernel choice, measured on
    demand by ``measure(shape, class, kernels)`` (candidate -> seconds) and cached in the JSON
    file ``path`` (:mod:`kvflow.kernels.timings_file`: written by rename; entries another
    process saved meanwhile are kept). ``shape.key(candidate, class)`` names an entry;
    ``classes`` are the row or length classes timed; ``label`` names the file in warnings.
    ``measuring_s``: wall seconds spent timing in this process."""

    def __init__(self, path: Path, kernels: NativeCpuKernels | None, measure: Callable,
                 candidates: tuple[str, ...], classes: tuple[int, ...], label: str) -> None:
        self.path, self.kernels, self.measure = path, kernels, measure
        self.candidates, self.classes, self.label = candidates, classes, label
        self.seconds = read_timings(path)
        self.measuring_s = 0.0

    def measure_missing(self, shape: Any) -> bool:
        """Time the classes of ``shape`` the cache lacks and save them; whether any was."""
        missing = [n for n in self.classes
                   if any(shape.key(c, n) not in self.seconds for c in self.candidates)]
        if not missing:
            return False
        start = time.perf_counter()
        for n in missing:
            measured = self.measure(shape, n, self.kernels)
            self.seconds.update({shape.key(c, n): measured[c] for c in self.candidates})
        self.measuring_s += time.perf_counter() - start
        write_timings(self.path, {**read_timings(self.path, warn=False), **self.seconds},
                      self.label)
        return True
