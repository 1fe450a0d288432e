"""Timing candidate kernels against each other on a shared CPU: the rule the per-CPU kernel
choices (LoRA's :mod:`kvflow.lora.cpu_kernel_choice`, prefill attention's
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

import torch

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
