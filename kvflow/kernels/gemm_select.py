"""Choosing each CPU GEMM's kernel by timing it on this CPU (``--cpu-gemm auto``).

Which kernel is fastest depends on the CPU (AVX2 or AVX512, bf16 dot products or not, cache
sizes), on the weight's shape and on the rows per call. On a 2-core AVX512 EPYC kvflow's C GEMM
beat oneDNN at batch 1 and lost to it at batch 64 (issue 23), so no fixed choice is right
everywhere. At engine start every GEMM shape class of the model is timed with each candidate
kernel, at a decode-sized, a batch-sized and a prefill-sized row count, and each module gets the
kernel with the lowest summed relative time. (On a 2-core Xeon with AMX kvflow's C GEMM on AMX
tiles beat oneDNN at one row and lost to it 2-4x at 2,048 prefill rows: a choice timed at 1 and
64 rows alone gave it the prefill GEMMs too.) Timings are cached in ``<cache_dir>/cpu_gemm/`` per CPU model and
flags, torch version, kernel sources and thread count, so the next start measures nothing.

Candidates (:data:`CANDIDATES`): ``native`` is kvflow's C GEMM (fp32 weights, or 16-bit weights
kept 16-bit in its panels and widened in registers; fp32 accumulation), ``onednn`` is oneDNN's
packed GEMM in the model dtype (for 16-bit only where the CPU has native 16-bit matmuls).
A 16-bit LM head always runs ``native`` (its logits must stay fp32, and oneDNN's 16-bit GEMM
rounds its output).

Where the fastest kernel changes once along the row classes (on the AMX Xeon: kvflow's AMX GEMM
at decode rows, oneDNN at prefill rows) and the model's GEMM weights are small enough to keep
twice (:data:`SPLIT_MAX_BYTES`), a shape class gets both (:class:`KernelSplit`): each call runs
the kernel that won its row range, split at the geometric midpoint of the two row classes
around the change.

Where the engine will replay its decode steps as CPU step graphs (``graphs``), only ``native``
can be recorded (:data:`REPLAYABLE`: ctypes calls; a oneDNN GEMM is a torch operator, which
makes the step unreplayable), so a near-tie at a decode row class is decided for ``native``
(:func:`graph_weighted`, :data:`GRAPH_MARGIN`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.config import cache_dir
from kvflow.kernels import cpu_build
from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.timings_file import read_timings, write_timings

logger = logging.getLogger(__name__)

CANDIDATES = ("native", "onednn")
# the winner of the class below keeps a decode row class (<= 64 rows) where it is within 10%
# of the fastest (row_class_winners)
SPLIT_TIE_MARGIN, SPLIT_TIE_MAX_ROWS = 0.10, 64
# --- the margin a non-replayable kernel must beat at decode row classes (graph_weighted) ---
# Losing the step graph makes the eager decode step GRAPH_STEP_SAVING longer than the replayed
# one: SmolLM2-135M fp32, 16 sequences, 2-core Zen 5 EPYC: 358 tok/s with a oneDNN decode GEMM
# (no replay) against 391-394 with every GEMM native (1.09-1.10x; docs/benchmarks.md, "Same
# results before and after session 35's features"). GEMMs are GEMM_STEP_SHARE of an eager
# decode step (session 28's profile of 64-row decode steps on that CPU: 1.655 of 2.755 s).
GRAPH_STEP_SAVING, GEMM_STEP_SHARE = 0.10, 0.60
# Switching every decode GEMM to a kernel that cuts its time by a fraction d pays only when
# d * GEMM_STEP_SHARE * (1 + GRAPH_STEP_SAVING) > GRAPH_STEP_SAVING (times in units of the
# replayed step), i.e. d > 0.152; timed as "other's time * (1 + margin) < native's", that is
# margin = 1 / (1 - d) - 1 = 0.179. A single shape class switching gains less (its own share of
# the step) and loses the same graph, so this is the least margin, lenient toward oneDNN.
GRAPH_MARGIN = 1 / (1 - GRAPH_STEP_SAVING / (GEMM_STEP_SHARE * (1 + GRAPH_STEP_SAVING))) - 1
REPLAYABLE = frozenset({"native"})  # kernels a CPU step graph records (kvflow's ctypes calls)
ROW_CLASSES = (1, 64, 512)  # rows per call: decode of one request, a batch of decodes, prefill
LARGE_N = 8192  # wider weights (LM heads) are timed on a LARGE_N-column slice, scaled up
# weights cycled per one-row timing, as in a model whose weights stream from memory: twice the
# last-level cache (timing_pool_bytes), within these bounds; POOL_BYTES where sysfs does not say
POOL_BYTES, POOL_MIN_BYTES, POOL_MAX_BYTES = 160 << 20, 32 << 20, 256 << 20
CPU_CACHE_SYSFS = "/sys/devices/system/cpu/cpu0/cache"
MAX_COPIES = 256
REPEATS = 4
SPLIT_MAX_BYTES = 512 << 20  # GEMM weights (one copy) up to which a shape may be packed twice


@dataclass(frozen=True)
class GemmShape:
    """A weight [n, k] of dtype ``dtype`` (one shape class; ``n`` above LARGE_N is timed on a
    slice)."""

    n: int
    k: int
    dtype: torch.dtype

    @property
    def timed_n(self) -> int:
        return min(self.n, LARGE_N)

    def key(self, candidate: str, rows: int) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}|{self.timed_n}x{self.k}|{candidate}|{rows}"


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


def timing_method(pool_bytes: int) -> str:
    """How GEMM timings are measured, part of their cache key: timings of another method,
    other row classes or another pool are redone."""
    return f"cpu-time-1-thread|alternating-{REPEATS}|rows {ROW_CLASSES}|pool {pool_bytes}"


def _pack(candidate: str, weight: torch.Tensor, kernels: NativeCpuKernels | None,
          copies: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """``copies`` distinct packed copies of ``weight`` for ``candidate``: packed once, the
    others byte copies of that packing (``clone``: 1.5-4x cheaper than packing again)."""
    from kvflow.kernels.gemm import NativePackedWeight, OneDnnPackedWeight

    first = NativePackedWeight(weight, kernels) if candidate == "native" else \
        OneDnnPackedWeight(weight, 64)
    packs = [first]
    for _ in range(copies - 1):
        twin = copy.copy(first)
        twin.packed = first.packed.clone()
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
    one thread ranks them as the engine's threads would. One-row calls cycle through a pool of
    distinct weights twice the last-level cache (:func:`timing_pool_bytes`), so they read
    their weight from memory as decode does in a model; larger calls, which are
    compute-bound, use two of them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_on_this_thread(shape, tuple(candidates), rows_list, kernels)
    finally:
        torch.set_num_threads(threads)


def _time_on_this_thread(shape: GemmShape, candidates: tuple[str, ...],
                         rows_list: Iterable[int], kernels: NativeCpuKernels | None
                         ) -> dict[str, dict[int, float]]:
    n, k = shape.timed_n, shape.k
    weight_bytes = max(1, n * k * shape.dtype.itemsize)
    copies = max(2, min(MAX_COPIES, timing_pool_bytes() // weight_bytes))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen).to(shape.dtype)
    fns = {c: _pack(c, weight, kernels, copies) for c in candidates}
    result: dict[str, dict[int, float]] = {c: {} for c in fns}
    for rows in rows_list:
        x = torch.randn(rows, k, generator=gen).to(shape.dtype)
        pools = {c: pool if rows == 1 else pool[:2] for c, pool in fns.items()}
        for pool in pools.values():
            pool[0](x)  # warm-up (first-call allocations)
        best = dict.fromkeys(pools, float("inf"))
        for _ in range(REPEATS):
            for c, pool in pools.items():
                start = time.process_time()
                for fn in pool:
                    fn(x)
                best[c] = min(best[c], (time.process_time() - start) / len(pool))
        for c in pools:
            result[c][rows] = best[c]
    return result


def time_candidate(shape: GemmShape, candidate: str, rows_list: Iterable[int],
                   kernels: NativeCpuKernels | None) -> dict[int, float]:
    """:func:`time_candidates` of one candidate."""
    return time_candidates(shape, (candidate,), rows_list, kernels)[candidate]


def cache_key(num_threads: int, isa: str = "", method: str | None = None) -> str:
    """What the timings depend on: the CPU model and flags, torch, kvflow's kernel sources,
    the ISA level of the loaded kernels, the thread count and how they are measured
    (``method``: another kernel's timings name theirs; default: :func:`timing_method` of
    :func:`timing_pool_bytes`, so a CPU with another cache size is timed again)."""
    method = timing_method(timing_pool_bytes()) if method is None else method
    digest = hashlib.sha256()
    csrc = Path(cpu_build.__file__).parent / "csrc"
    for part in [cpu_build.cpu_fingerprint(), torch.__version__, str(num_threads), isa,
                 method,
                 *(p.read_text() for p in sorted(csrc.glob("*.[ch]")))]:
        digest.update(part.encode())
    return digest.hexdigest()[:16]


class GemmTimings:
    """Seconds per GEMM call by (shape class, candidate, rows), measured on demand and cached
    in a JSON file. One engine start at a time writes it (rename into place)."""

    def __init__(self, path: Path, kernels: NativeCpuKernels | None) -> None:
        self.path, self.kernels = path, kernels
        self.seconds: dict[str, float] = read_timings(path)
        self._dirty = False
        self.measuring_s = 0.0  # spent timing kernels in this process

    def get(self, shape: GemmShape, candidate: str) -> dict[int, float]:
        """Seconds per call of ``candidate`` on ``shape`` at each of ROW_CLASSES, scaled to
        the full ``n`` of a sliced (wide) shape."""
        keys = {rows: shape.key(candidate, rows) for rows in ROW_CLASSES}
        missing = [rows for rows, key in keys.items() if key not in self.seconds]
        if missing:
            start = time.perf_counter()
            measured = time_candidate(shape, candidate, missing, self.kernels)
            self.measuring_s += time.perf_counter() - start
            self.seconds.update({keys[rows]: s for rows, s in measured.items()})
            self._dirty = True
        scale = shape.n / shape.timed_n
        return {rows: self.seconds[key] * scale for rows, key in keys.items()}

    def get_all(self, shape: GemmShape, candidates: Iterable[str]) -> dict[str, dict[int, float]]:
        """:meth:`get` of each candidate; those not cached yet are timed together, their
        passes alternating (:func:`time_candidates`)."""
        candidates = tuple(candidates)
        missing = [c for c in candidates
                   if any(shape.key(c, rows) not in self.seconds for rows in ROW_CLASSES)]
        if len(missing) > 1:
            start = time.perf_counter()
            measured = time_candidates(shape, missing, ROW_CLASSES, self.kernels)
            self.measuring_s += time.perf_counter() - start
            for c, secs in measured.items():
                self.seconds.update({shape.key(c, rows): s for rows, s in secs.items()})
            self._dirty = True
        return {c: self.get(shape, c) for c in candidates}

    def save(self) -> None:
        """Write new timings (atomically); a failure to write is logged, not raised."""
        if not self._dirty:
            return
        logger.info("timed CPU GEMM kernels in %.2f s (cached in %s)", self.measuring_s,
                    self.path)
        if write_timings(self.path, self.seconds, "GEMM timings"):
            self._dirty = False


def gemm_timings(kernels: NativeCpuKernels | None) -> GemmTimings:
    """The timings cache of this CPU, torch, kernel sources and thread count, under
    ``<cache_dir>/cpu_gemm/``."""
    name = f"{cache_key(torch.get_num_threads(), kernels.isa if kernels else '')}.json"
    return GemmTimings(Path(cache_dir()) / "cpu_gemm" / name, kernels)


def best_candidate(times: dict[str, dict[int, float]]) -> str:
    """The candidate with the lowest sum over row classes of its time relative to the fastest
    at that row count (each row class weighs the same, whatever its absolute time)."""
    fastest = {rows: min(t[rows] for t in times.values()) for rows in ROW_CLASSES}
    return min(times, key=lambda c: sum(times[c][r] / fastest[r] for r in ROW_CLASSES))


def candidates_for(dtype: torch.dtype, choice: str, kernels: NativeCpuKernels | None,
                   onednn: bool) -> tuple[str, ...]:
    """The kernels that may run GEMMs of ``dtype`` here, under ``--cpu-gemm`` = ``choice``:
    ``native`` where kvflow's kernels build, ``onednn`` where ``onednn`` (oneDNN packing in
    ``dtype``: any fp32, 16-bit only with native 16-bit matmul units). A forced choice that is
    unavailable falls back to what is; empty when neither is (the caller's torch path)."""
    allowed = tuple(c for c, ok in (("native", kernels is not None), ("onednn", onednn)) if ok)
    if choice in allowed:
        return (choice,)
    return allowed


@dataclass(frozen=True)
class KernelSplit:
    """Two kernels for one shape class: ``small`` for calls of up to ``max_small_rows`` rows,
    ``large`` above (the weight is packed for both)."""

    small: str
    large: str
    max_small_rows: int

    def __str__(self) -> str:
        return f"{self.small}<={self.max_small_rows}/{self.large}"


def split_candidate(times: dict[str, dict[int, float]]) -> KernelSplit | None:
    """A :class:`KernelSplit` when the fastest candidate changes exactly once along
    ROW_CLASSES (e.g. native at 1 and 64 rows, oneDNN at 512), split at the geometric midpoint
    of the two row classes around the change (181 rows between 64 and 512); else None. At a
    decode row class the winner of the class below keeps it when within
    :data:`SPLIT_TIE_MARGIN` of the fastest (:func:`row_class_winners`)."""
    winners = row_class_winners(times)
    changes = [i for i in range(1, len(winners)) if winners[i] != winners[i - 1]]
    if len(changes) != 1:
        return None
    i = changes[0]
    return KernelSplit(winners[0], winners[-1], math.isqrt(ROW_CLASSES[i - 1] * ROW_CLASSES[i]))


def row_class_winners(times: dict[str, dict[int, float]]) -> list[str]:
    """The fastest candidate at each row class of ROW_CLASSES, except that at a decode class
    (up to :data:`SPLIT_TIE_MAX_ROWS` rows) the winner of the class below keeps it when within
    :data:`SPLIT_TIE_MARGIN` of the fastest.

    Why: the classes are timed on one thread with the weight in cache, where kvflow's C GEMM
    and oneDNN come within 1-3% at 64 rows on SmolLM2's q/k/v weight on the AVX512-BF16 EPYC
    (0.359 vs 0.354 ms, 0.418 vs 0.405 in another cache), while the engine runs two threads
    and reads every weight from memory, where the C GEMM (the one-row winner) was 1.41-1.52x
    faster on the small shapes at 64 rows (docs/benchmarks.md, "the engine's GEMMs against the
    same GEMMs alone"). Prefill classes keep the plain fastest: there oneDNN leads by a few
    percent that do hold at two threads.
    """
    winners: list[str] = []
    for rows in ROW_CLASSES:
        fastest = min(times, key=lambda c: times[c][rows])
        keep = winners[-1] if winners and rows <= SPLIT_TIE_MAX_ROWS else fastest
        if times[keep][rows] <= times[fastest][rows] * (1 + SPLIT_TIE_MARGIN):
            fastest = keep
        winners.append(fastest)
    return winners


def graph_weighted(times: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """``times`` (seconds per call, by candidate and row class) with each candidate outside
    :data:`REPLAYABLE` charged ``1 + GRAPH_MARGIN`` times its time at the decode row classes
    (up to :data:`SPLIT_TIE_MAX_ROWS` rows), when some candidate is replayable; else
    unchanged. What :func:`choose` compares when the engine's decode steps would replay as CPU
    step graphs: a non-replayable decode GEMM costs the whole step graph, so it must be more
    than ``1 + GRAPH_MARGIN`` (1.18x) faster to be chosen (see :data:`GRAPH_MARGIN`'s
    derivation). E.g. gate_up 3072 x 576 fp32 on the quiet Zen 5, ms at 1 / 64 / 512 rows:
    native 0.241 / 0.893 / 7.00, oneDNN 0.215 / 0.999 / 7.01 (1.12x faster at one row) counts
    as 0.253 / 1.177 / 7.01 and loses every class."""
    if not any(c in REPLAYABLE for c in times):
        return times
    return {c: t if c in REPLAYABLE else
            {rows: s * (1 + GRAPH_MARGIN) if rows <= SPLIT_TIE_MAX_ROWS else s
             for rows, s in t.items()}
            for c, t in times.items()}


def choose(shape: GemmShape, candidates: tuple[str, ...], timings: GemmTimings | None,
           split: bool = False, graphs: bool = False) -> str | KernelSplit:
    """The kernel for ``shape``: the only candidate, or with ``split`` (both packings
    affordable) a :class:`KernelSplit` where the fastest changes along the row classes
    (:func:`split_candidate`), else the fastest by :func:`best_candidate`. With ``graphs``
    (the engine's decode steps would replay as CPU step graphs) the times compared are
    :func:`graph_weighted`'s."""
    if len(candidates) == 1 or timings is None:
        return candidates[0]
    times = timings.get_all(shape, candidates)
    if graphs:
        times = graph_weighted(times)
    return (split and split_candidate(times)) or best_candidate(times)


def transformer_gemm_shapes(hf_config) -> list[tuple[int, int, int]] | None:
    """(n, k, count) of each GEMM of a dense decoder (q/k/v, o, gate/up, down per layer, the LM
    head once) from its HF config, or None when the config is not of that kind (MoE, missing
    sizes)."""
    get = lambda name: getattr(hf_config, name, None)
    hidden, inter, layers = get("hidden_size"), get("intermediate_size"), get("num_hidden_layers")
    heads, vocab = get("num_attention_heads"), get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, inter, layers, heads, vocab)) \
            or any(get(n) for n in ("num_local_experts", "num_experts", "n_routed_experts")):
        return None
    head_dim = get("head_dim") or hidden // heads
    kv_heads = get("num_key_value_heads") or heads
    return [((heads + 2 * kv_heads) * head_dim, hidden, layers), (hidden, heads * head_dim, layers),
            (2 * inter, hidden, layers), (hidden, inter, layers), (vocab, hidden, 1)]


def estimated_step_seconds(shapes: list[tuple[int, int, int]], dtype: torch.dtype,
                           candidates: tuple[str, ...], timings: GemmTimings) -> dict[int, float]:
    """Seconds of a forward pass's GEMMs at each row class of ROW_CLASSES with the fastest
    candidate per shape (what :func:`choose_dtype` compares)."""
    total = dict.fromkeys(ROW_CLASSES, 0.0)
    for n, k, count in shapes:
        per = list(timings.get_all(GemmShape(n, k, dtype), candidates).values())
        for rows in ROW_CLASSES:
            total[rows] += count * min(t[rows] for t in per)
    return total


def choose_dtype(shapes: list[tuple[int, int, int]],
                 candidates: dict[torch.dtype, tuple[str, ...]], timings: GemmTimings
                 ) -> torch.dtype:
    """The dtype (a key of ``candidates``, which maps each to its kernels) whose GEMMs run a
    forward pass of ``shapes`` fastest: lowest sum over row classes of its time relative to the
    fastest dtype's. Ties keep the first key."""
    step = {d: estimated_step_seconds(shapes, d, c, timings) for d, c in candidates.items()}
    fastest = {rows: min(s[rows] for s in step.values()) for rows in ROW_CLASSES}
    return min(step, key=lambda d: sum(step[d][r] / fastest[r] for r in ROW_CLASSES))


def measure_cpu_dtype(hf_config, half: torch.dtype, choice: str,
                      onednn_packs: Callable[[torch.dtype], bool]) -> torch.dtype:
    """``--dtype auto`` on a CPU with native ``half`` (bf16/fp16) matmul units: ``half`` or
    float32, whichever runs the model's GEMMs (:func:`transformer_gemm_shapes`) faster with
    the kernels ``choice`` allows (:func:`choose_dtype`; timings cached). ``half`` when the
    model's shapes are unknown. ``onednn_packs(dtype)``: whether oneDNN may pack ``dtype``."""
    from kvflow.kernels.cpu_native import native_cpu_kernels

    shapes = transformer_gemm_shapes(hf_config)
    if shapes is None:
        return half
    kernels = native_cpu_kernels() if choice != "onednn" else None
    candidates = {d: candidates_for(d, choice, kernels, onednn_packs(d))
                  for d in (half, torch.float32)}
    candidates = {d: c for d, c in candidates.items() if c}
    if len(candidates) < 2:
        return half
    timings = gemm_timings(kernels)
    dtype = choose_dtype(shapes, candidates, timings)
    timings.save()
    logger.info("--dtype auto: %s (GEMMs timed in %s)", dtype,
                " and ".join(str(d) for d in candidates))
    return dtype
