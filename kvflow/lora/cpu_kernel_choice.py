"""Choosing the CPU LoRA kernel by timing it on this CPU (``KVFLOW_CPU_LORA=auto``, the default).

Two kernels can run a LoRA layer's grouped matmul on CPU: kvflow's C kernel (``native``,
``kernels/csrc/cpu_lora.c``: one call for every adapter of a step) and plain torch (``torch``,
:func:`kvflow.lora.layers.grouped_lora`: a matmul pair per adapter). Only the native one can be
recorded by a CPU step graph (its calls are ctypes calls), so choosing ``torch`` also runs the
LoRA engine's decode steps eagerly. Which kernel is faster per call depends on the CPU: on a
2-core Zen 5 EPYC session 49's kernel took 1.2-1.6x torch's time on 16-64 rows of one adapter,
session 50's (B^T rows added as whole vectors) 0.56-0.96x (docs/benchmarks.md). So, as for the
GEMMs (:mod:`kvflow.kernels.gemm_select`), each of the engine's LoRA layer shapes is timed with
both at the decode row counts :data:`ROW_CLASSES` and at :data:`EAGER_ROWS` (a prefill's), on
one thread by process CPU time, the candidates' passes alternating, all rows on one adapter
(torch's best case: a matmul pair and no gather), and the timings are cached in
``<cache_dir>/cpu_lora/`` per CPU model and flags, torch, kernel sources, ISA level and thread
count, so later starts measure nothing. SmolLM2-135M's four shapes took 0.05-0.08 s of CPU time
at rank 8-16, 0.14-0.18 s at rank 64 (0.08-0.43 s of wall time) on a 2-core Zen 5 EPYC at load
average 7, once per CPU.

The choice (:func:`choose`): the summed time of every LoRA layer of the model at each row class,
relative to the faster candidate's, summed over the classes; where the engine's decode steps
would replay, ``torch`` is charged ``1 + margin`` at each row class, since choosing it runs every
decode step eagerly: the margin is this CPU's (:func:`lora_graph_margins`, as
``gemm_select.graph_margins`` weighs a GEMM kernel that costs the step graph: an eager step's host
time, from this CPU's timed eager GEMM call, against the LoRA layers' time that ``torch`` could
save). A tie keeps ``native``. Eager steps (prefills, and every step where none replays)
run the native kernel at the row classes where it was timed no slower
(:func:`resolve_eager_cpu_lora`; a step takes the class of the most rows at most its own): at
SmolLM2's shapes it took 0.5-0.95x torch's time at 16-2048 rows, ranks 8-16, and 0.7-1.25x at
rank 64 (docs/benchmarks.md, session 50, eager LoRA).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvflow.config import cache_dir, cpu_lora_choice
from kvflow.kernels import gemm_timing
from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.cpu_timing import CachedTimings, alternating_cpu_seconds
from kvflow.kernels.gemm_select import GRAPH_MARGIN, graph_margins
from kvflow.kernels.gemm_timing import EAGER_CALL_KEY
from kvflow.kernels.gemm_timing_cache import cache_key
from kvflow.kernels.timings_file import read_timings, write_timings

logger = logging.getLogger(__name__)

CANDIDATES = ("native", "torch")
ROW_CLASSES = (1, 16, 64)  # decode rows per call: one request, a small and a large batch
EAGER_ROWS = 128  # a prefill's rows (timed too: an eager step of as many rows or more)
TIMED_ROWS = (*ROW_CLASSES, EAGER_ROWS)
REPEATS = 5  # alternating passes per candidate (the fastest kept)
CALLS = 2  # calls per pass
# at EAGER_ROWS: fewer, one call each (a call takes 0.4-4 ms at SmolLM2's shapes, ranks 8-64:
# the first start's timing stays under 0.2 s of CPU time)
EAGER_REPEATS, EAGER_CALLS = 3, 1
# part of the cache key: timings taken another way are redone
TIMING_METHOD = (f"lora|cpu-time-1-thread|alternating-{REPEATS}x{CALLS}|"
                 f"eager-{EAGER_REPEATS}x{EAGER_CALLS}|rows {TIMED_ROWS}|"
                 "one adapter|B^T rows")

Measure = Callable[["LoRAShape", int, "NativeCpuKernels | None"], dict[str, float]]
EagerCall = Callable[["NativeCpuKernels"], float]


@dataclass(frozen=True)
class LoRAShape:
    """One LoRA layer's matmul: ``in_features`` -> ``rank`` -> ``out`` with activations of
    ``dtype`` (fp32 slots)."""

    in_features: int
    out: int
    rank: int
    dtype: torch.dtype

    def key(self, candidate: str, rows: int) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}|{self.in_features}x{self.rank}x"
                f"{self.out}|{candidate}|{rows}")


def layer_shapes(layers: Iterable, dtype: torch.dtype) -> dict[LoRAShape, int]:
    """Each distinct :class:`LoRAShape` of ``layers`` (LoRALinear modules, slots ``lora_a
    [L, R, in]``, ``lora_b [L, out, R]``) with the number of layers of that shape."""
    counts: dict[LoRAShape, int] = {}
    for layer in layers:
        _, rank, in_features = layer.lora_a.shape
        shape = LoRAShape(in_features, layer.lora_b.shape[1], rank, dtype)
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def lora_calls(shape: LoRAShape, rows: int, kernels: NativeCpuKernels | None
               ) -> dict[str, Callable[[], torch.Tensor]]:
    """candidate -> a call of ``rows`` rows on one adapter of ``shape``, as a LoRA layer makes
    it (B kept as the layer keeps it on CPU: the transpose of a contiguous ``[L, R, out]``);
    ``native`` left out without kernels."""
    from kvflow.lora.layers import grouped_lora, make_mapping

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, shape.in_features, generator=gen).to(shape.dtype)
    y = torch.randn(rows, shape.out, generator=gen).to(shape.dtype)
    a = torch.randn(2, shape.rank, shape.in_features, generator=gen) * 0.01
    b = (torch.randn(2, shape.rank, shape.out, generator=gen) * 0.01).transpose(1, 2)
    slots = np.zeros(rows, dtype=np.int64)
    mapping = make_mapping(slots, torch.device("cpu"))
    calls = {"torch": lambda: grouped_lora(y, x, a, b, mapping)}
    if kernels is not None:
        row_slots = torch.zeros(rows, dtype=torch.int32)
        calls["native"] = lambda: kernels.lora(y, x, a, b, row_slots)
    return calls


def time_lora(shape: LoRAShape, rows: int, kernels: NativeCpuKernels | None
              ) -> dict[str, float]:
    """CPU seconds per call of each candidate of :func:`lora_calls` on one thread: the
    fastest of REPEATS passes of CALLS calls (EAGER_REPEATS of EAGER_CALLS at EAGER_ROWS or
    more), the candidates' passes alternating, after one
    warm-up call each (as :func:`kvflow.kernels.gemm_timing.time_candidates`, whose reasons
    hold here: timings are cached for good, and process CPU time on one thread is what other
    processes on a shared machine change least)."""
    repeats, per_pass = (REPEATS, CALLS) if rows < EAGER_ROWS else (EAGER_REPEATS, EAGER_CALLS)
    return alternating_cpu_seconds(lambda: lora_calls(shape, rows, kernels), repeats, per_pass)


class LoRATimings(CachedTimings):
    """Seconds per call by (shape, candidate, row class), measured on demand by ``measure``
    (default :func:`time_lora`) and cached (:class:`kvflow.kernels.cpu_timing.CachedTimings`),
    with this CPU's eager GEMM call (``eager_call``, default
    :func:`kvflow.kernels.gemm_timing.eager_call_seconds`: :meth:`eager_call_seconds`)."""

    def __init__(self, path: Path, kernels: NativeCpuKernels | None,
                 measure: Measure | None = None, eager_call: EagerCall | None = None) -> None:
        super().__init__(path, kernels, measure or time_lora, CANDIDATES, TIMED_ROWS,
                         "LoRA timings")
        self.eager_call = eager_call or (lambda k: gemm_timing.eager_call_seconds(k))

    def eager_call_seconds(self, kernels: NativeCpuKernels) -> float:
        """CPU seconds of one eager call of kvflow's GEMM on this CPU (``eager_call`` of
        ``kernels``: ~20 ms to time), cached under ``gemm_timing.EAGER_CALL_KEY`` as the GEMM
        timings cache it, so a later start times nothing."""
        if EAGER_CALL_KEY not in self.seconds:
            start = time.perf_counter()
            self.seconds[EAGER_CALL_KEY] = self.eager_call(kernels)
            self.measuring_s += time.perf_counter() - start
            write_timings(self.path, {**read_timings(self.path, warn=False), **self.seconds},
                          self.label)
        return self.seconds[EAGER_CALL_KEY]

    def get(self, shape: LoRAShape) -> dict[str, dict[int, float]]:
        """candidate -> row class (:data:`TIMED_ROWS`) -> seconds per call, timing the
        missing classes."""
        self.measure_missing(shape)
        return {c: {n: self.seconds[shape.key(c, n)] for n in TIMED_ROWS} for c in CANDIDATES}


def lora_timings(kernels: NativeCpuKernels) -> LoRATimings:
    """The timings cache of this CPU, torch, kernel sources, ISA level and thread count, under
    ``<cache_dir>/cpu_lora/``."""
    key = cache_key(torch.get_num_threads(), kernels.isa, TIMING_METHOD)
    return LoRATimings(Path(cache_dir()) / "cpu_lora" / f"{key}.json", kernels)


def step_seconds(shapes: dict[LoRAShape, int], timings: LoRATimings
                 ) -> dict[str, dict[int, float]]:
    """candidate -> row class -> seconds of one forward pass's LoRA layers (each shape's time
    times its layer count)."""
    total = {c: dict.fromkeys(TIMED_ROWS, 0.0) for c in CANDIDATES}
    for shape, count in shapes.items():
        for c, by_rows in timings.get(shape).items():
            for rows, seconds in by_rows.items():
                total[c][rows] += count * seconds
    return total


def choose(times: dict[str, dict[int, float]], graphs: bool,
           margins: dict[int, float] | None = None) -> str:
    """``native`` or ``torch`` from ``times`` (candidate -> row class -> seconds): the lower
    sum over row classes of time relative to the faster at that class, ``torch``'s times
    charged ``1 + margins[rows]`` when ``graphs`` (it would cost the decode steps' replay;
    ``margins``: :func:`lora_graph_margins`, this CPU's; None or a class it lacks:
    ``GRAPH_MARGIN``, 1.18x; an infinite margin: ``native``). A tie keeps ``native``."""
    margins = margins or {}
    charge = lambda n: 1 + margins.get(n, GRAPH_MARGIN) if graphs else 1.0
    charged = {"native": times["native"],
               "torch": {n: math.inf if math.isinf(charge(n)) else s * charge(n)
                         for n, s in times["torch"].items()}}
    fastest = {n: min(t[n] for t in charged.values()) for n in ROW_CLASSES}
    score = {c: sum(t[n] / fastest[n] for n in ROW_CLASSES) for c, t in charged.items()}
    return "native" if score["native"] <= score["torch"] else "torch"


def lora_graph_margins(native: dict[int, float], layers: int, eager_call_s: float,
                       threads: int) -> dict[int, float]:
    """The margin ``torch`` must beat at each decode row class of :data:`ROW_CLASSES` when
    choosing it would run the decode steps eagerly: ``gemm_select.graph_margins`` of the
    LoRA layers' seconds per forward pass with ``native`` (``native``: row class -> seconds,
    :func:`step_seconds`), ``layers`` LoRA layers and this CPU's eager call (``eager_call_s``,
    :meth:`LoRATimings.eager_call_seconds`) on ``threads`` threads. An eager step's host
    work is counted for the adapted modules only (a lower bound: every GEMM module of the
    model runs eagerly then, lenient toward ``torch``) and weighed against the LoRA
    layers' time alone, the only time ``torch`` can save. E.g. SmolLM2-135M fp32 with its
    seven projections adapted (210 layers) on the 2-core Ice Lake Xeon (an eager call 13.4
    us at load ~8): 70 ms of host work a step against LoRA layers of 5.1 / 7.7 / 17.3 ms
    (rank 8) and 6.0 / 20.3 / 58.6 ms (rank 64) at 1 / 16 / 64 rows on one thread: r > 1,
    infinite at every class, so no speed-up of torch's pays (docs/benchmarks.md, session 53).

    Raises:
        ValueError: on ``layers`` < 1, ``eager_call_s`` < 0 or ``threads`` < 1.
    """
    return graph_margins({n: native[n] for n in ROW_CLASSES}, layers, eager_call_s, threads)


def choose_eager(times: dict[str, dict[int, float]]) -> dict[int, str]:
    """Row class (:data:`TIMED_ROWS`) -> the kernel an eager step of that many rows runs:
    ``native`` where its time in ``times`` (candidate -> row class -> seconds) is at most
    ``torch``'s (no graph is at stake there)."""
    return {n: "native" if times["native"][n] <= times["torch"][n] else "torch"
            for n in TIMED_ROWS}


def eager_kernel(by_rows: dict[int, str], rows: int) -> str:
    """The kernel of an eager step of ``rows`` rows from :func:`choose_eager`'s classes: that
    of the largest class at most ``rows`` (the smallest class below it)."""
    return by_rows[max((n for n in by_rows if n <= rows), default=min(by_rows))]


def resolve_eager_cpu_lora(layers: Iterable, dtype: torch.dtype,
                           kernels: NativeCpuKernels | None,
                           timings: LoRATimings | None = None) -> dict[int, str]:
    """Row class -> the CPU LoRA kernel an eager (not replayed) step of that many rows runs,
    ``native`` or ``torch`` (:func:`eager_kernel` reads it): every class
    ``$KVFLOW_CPU_LORA`` when it names one, else (``auto``) :func:`choose_eager` of the
    timings of ``layers`` (the ones :func:`resolve_cpu_lora` reads: nothing more is timed);
    ``torch`` without native kernels.

    Args:
        layers: the LoRA layers whose shapes are timed.
        dtype: the model's activation dtype.
        kernels: the native kernels (None: unavailable).
        timings: the timings to decide by (None: :func:`lora_timings`).

    Raises:
        ValueError: when ``KVFLOW_CPU_LORA`` is not auto, native or torch.
    """
    choice = cpu_lora_choice()
    if kernels is None:
        choice = "torch"
    shapes = layer_shapes(layers, dtype) if choice == "auto" else {}
    if choice != "auto" or not shapes:
        return dict.fromkeys(TIMED_ROWS, "native" if choice == "auto" else choice)
    picked = choose_eager(step_seconds(shapes, timings or lora_timings(kernels)))
    logger.info("LoRA kernel on CPU in eager steps (KVFLOW_CPU_LORA=auto) from %s rows: %s",
                "/".join(map(str, TIMED_ROWS)), "/".join(picked.values()))
    return picked


def resolve_cpu_lora(layers: Iterable, dtype: torch.dtype, kernels: NativeCpuKernels | None,
                     graphs: bool = True, timings: LoRATimings | None = None) -> str:
    """The CPU LoRA kernel an engine runs, ``native`` or ``torch``: ``$KVFLOW_CPU_LORA`` when
    it names one, else (``auto``) the one :func:`choose` picks from the timings of ``layers``
    (the model's LoRALinear modules, activations of ``dtype``); ``torch`` without native
    kernels. Logged once at INFO under ``auto`` (with the time spent timing, if any).

    Args:
        layers: the LoRA layers whose shapes are timed.
        dtype: the model's activation dtype.
        kernels: the native kernels (None: unavailable).
        graphs: whether the engine's decode steps replay when ``native`` is chosen.
        timings: the timings to decide by (None: :func:`lora_timings`).

    Raises:
        ValueError: when ``KVFLOW_CPU_LORA`` is not auto, native or torch.
    """
    choice = cpu_lora_choice()
    if kernels is None:
        return "torch"
    if choice != "auto":
        return choice
    shapes = layer_shapes(layers, dtype)
    if not shapes:
        return "native"
    timings = timings or lora_timings(kernels)
    times = step_seconds(shapes, timings)
    margins = lora_graph_margins(times["native"], sum(shapes.values()),
                                 timings.eager_call_seconds(kernels),
                                 torch.get_num_threads()) if graphs else None
    picked = choose(times, graphs, margins)
    measured = f"timed in {timings.measuring_s:.2f} s, cached in {timings.path}" \
        if timings.measuring_s else f"timings cached in {timings.path}"
    logger.info("LoRA kernel on CPU (KVFLOW_CPU_LORA=auto): %s; a forward pass's LoRA layers "
                "at %s rows: native %s us, torch %s us (%s)", picked,
                "/".join(map(str, ROW_CLASSES)), _us(times["native"]), _us(times["torch"]),
                measured)
    return picked


def _us(by_rows: dict[int, float]) -> str:
    return "/".join(f"{by_rows[n] * 1e6:.0f}" for n in ROW_CLASSES)
