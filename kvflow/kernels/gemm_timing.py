"""Timing the CPU GEMM kernels on this CPU for ``--cpu-gemm auto`` (the choice itself:
:mod:`kvflow.kernels.gemm_select`): each GEMM shape class (:class:`GemmShape`) with each
candidate kernel at :data:`ROW_CLASSES` rows, on one thread by process CPU time, the candidates'
passes alternating (stopping early on a clear leader or settled passes); the results are
cached in ``<cache_dir>/cpu_gemm/`` per CPU model and flags, torch version, kernel sources,
thread count and timing method (:mod:`kvflow.kernels.gemm_timing_cache`), so the next start
measures nothing.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.cpu_timing import alternating_cpu_seconds
from kvflow.platforms.cpu_memory import HugePageArena

ROW_CLASSES = (1, 64, 512)  # rows per call: decode of one request, a batch of decodes, prefill
# The prefill class of an engine (row_classes): its step budget's rows, within these bounds
PREFILL_ROWS_MIN, PREFILL_ROWS_MAX = 128, 2048
LARGE_N = 8192  # wider weights (LM heads) are timed on a LARGE_N-column slice, scaled up
# weights cycled per one-row timing, as in a model whose weights stream from memory: twice the
# last-level cache (timing_pool_bytes), within these bounds; POOL_BYTES where sysfs does not say
POOL_BYTES, POOL_MIN_BYTES, POOL_MAX_BYTES = 160 << 20, 32 << 20, 256 << 20
CPU_CACHE_SYSFS = "/sys/devices/system/cpu/cpu0/cache"
MAX_COPIES = 256
REPEATS = 4
LARGE_REPEATS = 2  # passes from ONE_COPY_MIN_ROWS rows, without a warm-up call (repeats_at)
# calls of at least this many rows time one weight copy per pass (fewer rows: two); see
# pass_copies
ONE_COPY_MIN_ROWS = 1024
# ... and on a slice of at most this many output columns, scaled up (GemmShape.timed_cols):
# such a call is compute-bound, its time per column the same on a slice
COMPUTE_N = 512
# the passes stop early once, after EARLY_STOP_PASSES, one candidate is CLEAR_RATIO times
# faster than every other (clear_leader) or every candidate's two fastest passes lie within
# SETTLED_SPREAD of each other (settled)
EARLY_STOP_PASSES, CLEAR_RATIO, SETTLED_SPREAD = 2, 1.3, 1.03
# this CPU's host speed (eager_call_seconds): one eager call of kvflow's GEMM on a tiny weight,
# the minimum over EAGER_CALL_PASSES passes of EAGER_CALLS_PER_PASS calls (~20 ms in all on
# the Ice Lake Xeon), cached in the GEMM timings under EAGER_CALL_KEY
EAGER_CALL_PASSES, EAGER_CALLS_PER_PASS, EAGER_CALL_N = 5, 400, 32
EAGER_CALL_KEY = "host|eager native GEMM call, 1 row, 32x32 float32"


@dataclass(frozen=True)
class GemmShape:
    """A weight [n, k] of dtype ``dtype`` (one shape class; ``n`` above LARGE_N, or above
    COMPUTE_N from ONE_COPY_MIN_ROWS rows, is timed on a slice: :meth:`timed_cols`)."""

    n: int
    k: int
    dtype: torch.dtype

    @property
    def timed_n(self) -> int:
        return min(self.n, LARGE_N)

    def timed_cols(self, rows: int) -> int:
        """Output columns a ``rows``-row call is timed on (its time is scaled by ``n`` over
        them): at most :data:`LARGE_N`, and from :data:`ONE_COPY_MIN_ROWS` rows at most
        :data:`COMPUTE_N`. Why the second: such a call is compute-bound and both kernels split
        it over output columns, so its time per column is the same on a slice; on a 2-core
        Ice Lake Xeon (fp32, 2,048 rows) SmolLM2's 512-column slices timed within 6% of the
        full weights per column and ranked the kernels as they do (oneDNN / kvflow 0.79-0.85
        against 0.78-0.83), at 47% of the prefill class's timed work (gate/up's 3,072
        columns: a sixth; docs/benchmarks.md, session 51)."""
        return min(self.timed_n, COMPUTE_N) if rows >= ONE_COPY_MIN_ROWS else self.timed_n

    def key(self, candidate: str, rows: int) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}|{self.timed_cols(rows)}x{self.k}" \
            f"|{candidate}|{rows}"


def row_classes(max_num_batched_tokens: int | None) -> tuple[int, int, int]:
    """The row classes an engine's GEMMs are timed at: :data:`ROW_CLASSES` with the prefill
    class at the rows of the engine's prefill calls, ``max_num_batched_tokens`` (a step's
    token budget: long prompts run in chunks of that many rows) within [PREFILL_ROWS_MIN,
    PREFILL_ROWS_MAX]; ROW_CLASSES when None (not known). Why: on Zen 5 (bf16, 8-row
    micro-kernels) kvflow's GEMM beat oneDNN at 512 rows on q/k/v and o while oneDNN was
    6-10% faster at the 2,048 rows of CPU-W1's prefill calls (docs/benchmarks.md, session
    50), so a class timed at 512 rows could give prefill the slower kernel. The cap bounds the
    first start's timing (a 2,048-row call costs 4x a 512-row one); the floor keeps the class
    above the 64-row decode class."""
    if max_num_batched_tokens is None:
        return ROW_CLASSES
    prefill = min(PREFILL_ROWS_MAX, max(PREFILL_ROWS_MIN, max_num_batched_tokens))
    return (ROW_CLASSES[0], ROW_CLASSES[1], prefill)


def head_row_classes(rows: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The row classes of ``rows`` an LM head is timed at: those of at most ``max_num_seqs``
    rows (the head only gets each sequence's sampled row, never a prefill chunk's), the
    smallest class at least. Timing a wide fp32 head at 2,048 rows (an 8,192-column slice:
    ~19 GFLOP a call) cost a first start more than all the other shapes together and weighed
    a row count the head never runs."""
    return tuple(r for r in rows if r <= max_num_seqs) or tuple(rows[:1])


def timing_pool_bytes(sysfs: str = CPU_CACHE_SYSFS) -> int:
    """Bytes of distinct weight copies a one-row timing cycles through: twice the largest
    cache Linux lists for CPU 0 (``index*/size``, e.g. ``32768K``: the last-level cache), so
    each call reads its weight from memory, clamped to [POOL_MIN_BYTES, POOL_MAX_BYTES];
    POOL_BYTES where sysfs lists no cache (another OS, a container hiding it)."""
    sizes = []
    for path in Path(sysfs).glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    if not sizes:
        return POOL_BYTES
    return min(POOL_MAX_BYTES, max(POOL_MIN_BYTES, 2 * max(sizes)))


def timing_method(pool_bytes: int, rows: tuple[int, ...] = ROW_CLASSES) -> str:
    """How GEMM timings are measured, part of their cache key: timings of another method,
    other row classes (``rows``, :func:`row_classes`) or another pool are redone."""
    return f"cpu-time-1-thread|alternating-{REPEATS}|rows {tuple(rows)}|pool {pool_bytes}" \
        f"|native on huge pages|one copy from {ONE_COPY_MIN_ROWS} rows|pool shared" \
        f"|{COMPUTE_N} columns from {ONE_COPY_MIN_ROWS} rows" \
        f"|{LARGE_REPEATS} passes, no warm-up from {ONE_COPY_MIN_ROWS} rows|dtypes alternating" \
        f"|stop after {EARLY_STOP_PASSES} at {CLEAR_RATIO}x or within {SETTLED_SPREAD}"


def settled(passes: dict[str, list[float]], spread: float = SETTLED_SPREAD) -> bool:
    """Whether each candidate's two fastest passes so far (``passes``: candidate -> seconds
    per call of each pass) lie within ``spread`` of each other, its minimum then taken as
    measured: e.g. [20.0, 20.4] at 1.03: yes; [20.0, 21.0]: no; a single pass, or one read
    as 0 seconds: no.

    Why: each pass of a one-row call already averages a pool of calls (5-75 for SmolLM2's
    shapes) and a 2,048-row call runs 10-75 ms, so two passes that agree leave little for
    the last two of REPEATS (which cost as much again) to find; a pass that a busy moment
    slowed keeps the passes going. On a 2-core Ice Lake Xeon at load ~19 SmolLM2's fp32
    passes spread (slowest / fastest of 4) by 0-10% at one row and 0.5-22% at 2,048 rows
    (docs/benchmarks.md, session 51)."""
    for times in passes.values():
        if len(times) < 2:
            return False
        fastest, second = sorted(times)[:2]
        if fastest <= 0 or second > fastest * spread:
            return False
    return True


def clear_leader(best: dict[str, float], ratio: float = CLEAR_RATIO) -> bool:
    """Whether one of ``best`` (candidate -> its fastest pass so far, seconds) is more than
    ``ratio`` times faster than every other: a lead that size is more than the passes' noise
    (0-10% at one row on a loaded 2-core Xeon, :func:`settled`), so more passes, which only
    lower each candidate's minimum, are not expected to change which kernel wins. E.g.
    {native: 1.0, onednn: 1.4} at 1.3: yes; {native: 1.0, onednn: 1.2}: no; one candidate:
    no (nothing to decide early; its REPEATS passes are its measurement); a pass read as 0
    seconds (under the clock's tick): no.

    Why 1.3: above the decode-row tie margin (10%, ``gemm_select.SPLIT_TIE_MARGIN``) and the
    fixed step-graph margin (1.18x, ``gemm_select.GRAPH_MARGIN``), so a lead this size decides
    the kernel whatever the later passes would have measured. Against a larger per-CPU
    step-graph margin (``gemm_select.graph_margins``: ~1.6x at 64 rows on the Ice Lake Xeon)
    a 1.3x oneDNN lead at a decode row class is not decisive: the choice compares the
    minima of the passes run (two at least), as for any lead."""
    if len(best) < 2:
        return False
    fastest, second = sorted(best.values())[:2]
    return 0 < fastest * ratio < second


def pass_copies(rows: int, pool: int) -> int:
    """Weight copies one timing pass of a ``rows``-row call runs (of a ``pool``-copy pool):
    all of them at one row (read from memory, as decode reads its weights), one from
    :data:`ONE_COPY_MIN_ROWS` rows, two between. A call that large is compute-bound (SmolLM2's
    960 x 576 bf16 weight at 2,048 rows: ~5.5 ms, 2,048 uses of each weight byte), so a second
    copy adds time, not a different measurement: it made the 2,048-row prefill class most of
    a first start's timing (session 50: 1.20-1.28 CPU s for SmolLM2 bf16's four shapes)."""
    if rows == 1:
        return pool
    return 1 if rows >= ONE_COPY_MIN_ROWS else min(2, pool)


def pool_copies(pool_bytes: int, weight_bytes: int, candidates: int) -> int:
    """Distinct copies of a ``weight_bytes`` weight each of ``candidates`` kernels timed
    together cycles through at one row: their pools together fill ``pool_bytes``
    (:func:`timing_pool_bytes`, twice the last-level cache), 2 to :data:`MAX_COPIES` each.

    Why shared: the candidates' passes alternate (A, B, A, B), so between two reads of a copy of
    A's pool every other copy of it and all of B's pool are read: the same ``pool_bytes`` of
    other data as one candidate cycling a pool of its own that size, so each call still reads
    its weight from memory. Each pool of its own cost a first start two ~96 MiB packings per
    shape on a 48 MiB-L3 Ice Lake Xeon, and their passes twice the memory streamed (the one-row
    class was ~half of ``--dtype auto``'s timing there: docs/benchmarks.md, session 52)."""
    return max(2, min(MAX_COPIES, pool_bytes // (weight_bytes * max(1, candidates))))


def _pack(candidate: str, weight: torch.Tensor, kernels: NativeCpuKernels | None,
          copies: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """``copies`` distinct packed copies of ``weight`` for ``candidate``: packed once, the
    others byte copies of that packing (1.5-4x cheaper than packing again). kvflow's copies
    lie in a :class:`HugePageArena`, as the engine's packed weights do."""
    from kvflow.kernels.gemm import NativePackedWeight, OneDnnPackedWeight

    arena = HugePageArena() if candidate == "native" else None
    first = NativePackedWeight(weight, kernels, arena) if arena is not None else \
        OneDnnPackedWeight(weight, 64)
    packs = [first]
    for _ in range(copies - 1):
        twin = copy.copy(first)
        twin.packed = first.packed.clone() if arena is None else \
            arena.empty(first.packed.numel(), first.packed.dtype).copy_(first.packed)
        packs.append(twin)
    if candidate == "native":
        return [lambda x, p=p: p(x, None, x.dtype) for p in packs]
    return [lambda x, p=p: p(x, None) for p in packs]


def time_candidates(shape: GemmShape, candidates: Iterable[str], rows_list: Iterable[int],
                    kernels: NativeCpuKernels | None) -> dict[str, dict[int, float]]:
    """CPU seconds per call of each of ``candidates`` on ``shape`` for each row count, on one
    thread: the minimum over REPEATS passes, the candidates' passes alternating (A, B, A, B,
    ...). Timings are cached for good, and on a shared machine the load changes from one second
    to the next: one candidate timed after the other could win by running in the quieter moment
    (measured on a 2-core EPYC at load 5: a cached native 3072 x 576 bf16 GEMM at 64 rows of
    2.8 ms against oneDNN's 0.61, where both run ~1.2 ms on a quiet core). Wall time of a
    multi-threaded call is worse still: a thread descheduled for a scheduler slice stalls the
    call (a 2-core Xeon at load 6 timed a one-row 960 x 576 bf16 GEMM at 15 ms, ~100x its
    cost). So each call runs on one thread and counts the process's CPU time, which other
    processes barely change; both kernels split a call over output columns the same way, so
    one thread ranks them as the engine's threads would. One-row calls cycle through pools of
    distinct weights, the candidates' pools together twice the last-level cache
    (:func:`timing_pool_bytes`, :func:`pool_copies`), so they read their weight from memory as
    decode does in a model; larger calls, which are
    compute-bound, use two of them, and one from :data:`ONE_COPY_MIN_ROWS` rows
    (:func:`pass_copies`), on a :data:`COMPUTE_N`-column slice (:meth:`GemmShape.timed_cols`;
    the seconds returned are the slice's). The passes at a row count stop after
    :data:`EARLY_STOP_PASSES` once one candidate leads every other by :data:`CLEAR_RATIO`
    (:func:`clear_leader`) or every candidate's passes agree within :data:`SETTLED_SPREAD`
    (:func:`settled`); from :data:`ONE_COPY_MIN_ROWS` rows there is no warm-up call and
    :data:`LARGE_REPEATS` passes (:func:`repeats_at`)."""
    return _time_together({shape: tuple(candidates)}, rows_list, kernels)[shape]


def time_dtypes(by_shape: dict[GemmShape, tuple[str, ...]], rows_list: Iterable[int],
                kernels: NativeCpuKernels | None) -> dict[GemmShape, dict[str, dict[int, float]]]:
    """:func:`time_candidates` of one weight ``n x k`` in several dtypes at once: each shape
    of ``by_shape`` (all of one ``n`` and ``k``, e.g. bf16 and fp32) with its candidates,
    every (dtype, candidate) pair's passes alternating with all the others' (bf16, fp32
    kvflow, fp32 oneDNN, bf16, ...), so a change of load between them hits every dtype alike
    (``--dtype auto`` timed bf16's shapes before fp32's, each against its own moment's
    load). The pairs share one one-row pool (:func:`pool_copies` of their weights' bytes
    together: bf16's copies half fp32's bytes) and each row count's operand (the same values,
    rounded to each dtype). Returns shape -> candidate -> rows -> seconds per call.

    Raises:
        ValueError: when the shapes of ``by_shape`` differ in ``n`` or ``k``.
    """
    if len({(s.n, s.k) for s in by_shape}) > 1:
        raise ValueError(f"time_dtypes times one n x k in several dtypes, got "
                         f"{sorted({(s.n, s.k) for s in by_shape})}")
    return _time_together(by_shape, rows_list, kernels)


def _time_together(by_shape: dict[GemmShape, tuple[str, ...]], rows_list: Iterable[int],
                   kernels: NativeCpuKernels | None
                   ) -> dict[GemmShape, dict[str, dict[int, float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pairs = tuple((s, c) for s, cands in by_shape.items() for c in cands)
        timed = _time_on_this_thread(pairs, tuple(rows_list), kernels)
    finally:
        torch.set_num_threads(threads)
    return {s: {c: timed[(s, c)] for c in cands} for s, cands in by_shape.items()}


def repeats_at(rows: int) -> tuple[bool, int]:
    """(whether a warm-up call precedes the passes, the most passes) at ``rows`` rows:
    (True, :data:`REPEATS`) below :data:`ONE_COPY_MIN_ROWS`, else (False,
    :data:`LARGE_REPEATS`). Why: such a call runs 10-75 ms on one weight copy (SmolLM2's
    512-column slices at 2,048 rows on the Ice Lake Xeon), its first call was within its
    passes' noise (17.1 against 15.2-15.8 ms, bf16 512 x 576; 33.2 against 31.3-38.2,
    oneDNN 512 x 1536) and the passes spread 10-20% from call to call under load, so they
    rarely settle within :data:`SETTLED_SPREAD`: a warm-up and four passes of three
    candidates made the 2,048-row class over half of ``--dtype auto``'s first-start timing
    (docs/benchmarks.md, session 53)."""
    return (True, REPEATS) if rows < ONE_COPY_MIN_ROWS else (False, LARGE_REPEATS)


def _time_on_this_thread(pairs: tuple[tuple[GemmShape, str], ...], rows_list: tuple[int, ...],
                         kernels: NativeCpuKernels | None
                         ) -> dict[tuple[GemmShape, str], dict[int, float]]:
    first = pairs[0][0]
    n, k = first.timed_n, first.k
    weight_bytes = sum(n * k * s.dtype.itemsize for s, _ in pairs)
    copies = pool_copies(timing_pool_bytes(), max(1, weight_bytes), 1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen)
    packed: dict[int, dict[tuple[GemmShape, str], list]] = {}  # by the columns timed
    result: dict[tuple[GemmShape, str], dict[int, float]] = {p: {} for p in pairs}
    for rows in rows_list:
        cols = first.timed_cols(rows)
        if cols not in packed:
            packed[cols] = {(s, c): _pack(c, weight[:cols].to(s.dtype), kernels,
                                          copies if cols == n else 1) for s, c in pairs}
        x = torch.randn(rows, k, generator=gen)
        xs = {s.dtype: x.to(s.dtype) for s, _ in pairs}
        pools = {p: pool[:pass_copies(rows, len(pool))] for p, pool in packed[cols].items()}
        warm_up, repeats = repeats_at(rows)
        if warm_up:
            for (s, _), pool in pools.items():
                pool[0](xs[s.dtype])  # first-call allocations
        passes: dict[tuple[GemmShape, str], list[float]] = {p: [] for p in pools}
        for i in range(repeats):
            for p, pool in pools.items():
                xp = xs[p[0].dtype]
                start = time.process_time()
                for fn in pool:
                    fn(xp)
                passes[p].append((time.process_time() - start) / len(pool))
            best = {p: min(times) for p, times in passes.items()}
            if i + 1 >= EARLY_STOP_PASSES and (clear_leader(best) or settled(passes)):
                break
        for p in pools:
            result[p][rows] = best[p]
    return result


def time_candidate(shape: GemmShape, candidate: str, rows_list: Iterable[int],
                   kernels: NativeCpuKernels | None) -> dict[int, float]:
    """:func:`time_candidates` of one candidate."""
    return time_candidates(shape, (candidate,), rows_list, kernels)[candidate]


def eager_call_seconds(kernels: NativeCpuKernels) -> float:
    """CPU seconds of one eager call of kvflow's packed GEMM on a 32 x 32 fp32 weight and one
    row, through its Python wrapper (:class:`~kvflow.kernels.gemm.NativePackedWeight`: the
    operand checks, ``torch.empty`` of the output, the ctypes call), on one thread: the
    minimum over :data:`EAGER_CALL_PASSES` passes of :data:`EAGER_CALLS_PER_PASS` calls. The
    product itself is 2,048 FLOPs (under 0.1 us), so this is host time: the kind of work
    (Python calls, torch operator dispatch, ctypes) an eager decode step spends between its
    kernels and a replayed CPU step graph does not (9.3-9.5 us on the 2-core Ice Lake Xeon).
    ``gemm_select.graph_margins`` scales it to an eager step's host time."""
    from kvflow.kernels.gemm import NativePackedWeight

    def make_calls():
        gen = torch.Generator().manual_seed(0)
        weight = NativePackedWeight(torch.randn(EAGER_CALL_N, EAGER_CALL_N, generator=gen),
                                    kernels)
        x = torch.randn(1, EAGER_CALL_N, generator=gen)
        return {"eager": lambda: weight(x, None, torch.float32)}

    return alternating_cpu_seconds(make_calls, EAGER_CALL_PASSES, EAGER_CALLS_PER_PASS)["eager"]
