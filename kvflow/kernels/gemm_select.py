"""Choosing each CPU GEMM's kernel by timing it on this CPU (``--cpu-gemm auto``).

Which kernel is fastest depends on the CPU (AVX2 or AVX512, bf16 dot products or not, cache
sizes), on the weight's shape and on the rows per call. On a 2-core AVX512 EPYC kvflow's C GEMM
beat oneDNN at batch 1 and lost to it at batch 64 (issue 23), so no fixed choice is right
everywhere. At engine start every GEMM shape class of the model is timed with each candidate
kernel, at a decode-sized, a batch-sized and a prefill-sized row count (the engine's step budget,
``max_num_batched_tokens``, capped at 2,048: :func:`~kvflow.kernels.gemm_timing.row_classes`),
and each module gets the kernel with the lowest summed relative time. (On a 2-core Xeon with AMX kvflow's C GEMM on AMX
tiles beat oneDNN at one row and lost to it 2-4x at 2,048 prefill rows: a choice timed at 1 and
64 rows alone gave it the prefill GEMMs too.) Timings are cached in ``<cache_dir>/cpu_gemm/`` per CPU model and
flags, torch version, kernel sources and thread count, so the next start measures nothing
(the timing and its cache: :mod:`kvflow.kernels.gemm_timing`).

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
makes the step unreplayable), so at a decode row class oneDNN must be faster by a margin that
pays for the lost replay (:func:`graph_weighted`). The margin is this CPU's and this model's
(:func:`graph_margins`): the host time an eager step spends per GEMM module (from this CPU's
timed eager call, :data:`EAGER_CALLS_PER_GEMM`) against the model's GEMM time at that row
class (already timed); :data:`GRAPH_MARGIN` where that is not known.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.gemm_timing import ROW_CLASSES, GemmShape, head_row_classes
from kvflow.kernels.gemm_timing_cache import GemmTimings, gemm_timings

logger = logging.getLogger(__name__)

CANDIDATES = ("native", "onednn")
# the winner of the class below keeps a decode row class (<= 64 rows) where it is within 10%
# of the fastest (row_class_winners)
SPLIT_TIE_MARGIN, SPLIT_TIE_MAX_ROWS = 0.10, 64
# --- the fixed margin a non-replayable kernel must beat at decode row classes (graph_weighted
# where no per-CPU margins are given; LoRA's where its own are not) ---
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
# --- per CPU and model (graph_margins) ---
# An eager decode step spends, per GEMM module of the model, about EAGER_CALLS_PER_GEMM times
# the host CPU time of one eager tiny GEMM call (gemm_timing.eager_call_seconds) more than the
# replayed step: SmolLM2-135M fp32, batch 1, one thread, 2-core Ice Lake Xeon: eager 78-99
# against replayed 49-63 CPU ms per step, 29-36 ms over 121 GEMM modules = 0.24-0.29 ms each,
# where the eager tiny call took 9.3-9.5 us: 25-31 calls, the low end taken (lenient toward
# oneDNN; docs/benchmarks.md, session 52).
EAGER_CALLS_PER_GEMM = 25
REPLAYABLE = frozenset({"native"})  # kernels a CPU step graph records (kvflow's ctypes calls)
SPLIT_MAX_BYTES = 512 << 20  # GEMM weights (one copy) up to which a shape may be packed twice

def timed_rows(times: dict[str, dict[int, float]]) -> tuple[int, ...]:
    """The row classes of ``times`` (seconds by candidate, then rows), ascending: the
    timings' own (``GemmTimings.rows``), e.g. (1, 64, 2048) for an engine whose prefill calls
    have 2,048 rows."""
    return tuple(sorted(next(iter(times.values()))))


def best_candidate(times: dict[str, dict[int, float]]) -> str:
    """The candidate with the lowest sum over row classes of its time relative to the fastest
    at that row count (each row class weighs the same, whatever its absolute time)."""
    row_classes = timed_rows(times)
    fastest = {rows: min(t[rows] for t in times.values()) for rows in row_classes}
    return min(times, key=lambda c: sum(times[c][r] / fastest[r] for r in row_classes))


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
    """A :class:`KernelSplit` when the fastest candidate changes exactly once along the row
    classes (e.g. native at 1 and 64 rows, oneDNN at 512), split at the geometric midpoint
    of the two row classes around the change (181 rows between 64 and 512, 362 between 64 and
    2,048); else None. At a
    decode row class the winner of the class below keeps it when within
    :data:`SPLIT_TIE_MARGIN` of the fastest (:func:`row_class_winners`)."""
    winners = row_class_winners(times)
    changes = [i for i in range(1, len(winners)) if winners[i] != winners[i - 1]]
    if len(changes) != 1:
        return None
    i, row_classes = changes[0], timed_rows(times)
    return KernelSplit(winners[0], winners[-1], math.isqrt(row_classes[i - 1] * row_classes[i]))


def row_class_winners(times: dict[str, dict[int, float]]) -> list[str]:
    """The fastest candidate at each row class of ``times`` (ascending), except that at a decode class
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
    for rows in timed_rows(times):
        fastest = min(times, key=lambda c: times[c][rows])
        keep = winners[-1] if winners and rows <= SPLIT_TIE_MAX_ROWS else fastest
        if times[keep][rows] <= times[fastest][rows] * (1 + SPLIT_TIE_MARGIN):
            fastest = keep
        winners.append(fastest)
    return winners


def graph_margin(host_s: float, gemm_s: float, threads: int) -> float:
    """The margin a non-replayable kernel must beat at one decode row class: ``host_s``
    seconds of host work a replayed step saves, ``gemm_s`` the step's GEMM seconds on one
    thread (kvflow's kernel), run on ``threads`` threads (the host work is serial, the GEMMs
    split). Switching every decode GEMM to a kernel that cuts their time by a fraction d pays
    when d * gemm_s / threads > host_s, i.e. d > r = host_s * threads / gemm_s; timed as
    "other's time * (1 + margin) < native's" that is margin = 1 / (1 - r) - 1, and infinite
    (no speed-up pays) from r = 1. E.g. r = 0.1: 0.111; r = 0.4: 0.667. (Zen 5 figures as
    :data:`GRAPH_MARGIN`: replay 10% of the replayed step, GEMMs 60% of the eager one, r =
    1 / 6.6.) A single shape class switching gains less and loses the same step graph, so
    this is the least margin, lenient toward the other kernel.

    Raises:
        ValueError: on ``host_s`` < 0, ``gemm_s`` <= 0 or ``threads`` < 1.
    """
    if host_s < 0 or gemm_s <= 0 or threads < 1:
        raise ValueError(f"graph_margin needs host_s >= 0, gemm_s > 0 and threads >= 1, got "
                         f"{host_s}, {gemm_s}, {threads}")
    ratio = host_s * threads / gemm_s
    return math.inf if ratio >= 1 else 1 / (1 - ratio) - 1


def graph_margins(native_seconds: dict[int, float], modules: int, eager_call_s: float,
                  threads: int) -> dict[int, float]:
    """:func:`graph_margin` at each decode row class (up to :data:`SPLIT_TIE_MAX_ROWS` rows)
    of ``native_seconds`` (rows -> seconds of all the model's GEMM calls of a step at that
    row count with kvflow's kernel, one thread, as timed), for a model of ``modules`` GEMM
    modules on this CPU (``eager_call_s``: :func:`~kvflow.kernels.gemm_timing.eager_call_seconds`;
    an eager step's host time: ``modules * EAGER_CALLS_PER_GEMM * eager_call_s``) run on
    ``threads`` threads. E.g. SmolLM2-135M fp32 on the 2-core Ice Lake Xeon (121 modules x
    25 x 9.4 us = 28.4 ms of host work, 2 threads): against 55 ms of GEMMs at one row r =
    1.03, infinite; against 153 ms at 64 rows r = 0.37, 0.59.

    Raises:
        ValueError: on ``modules`` < 1 (and as :func:`graph_margin`).
    """
    if modules < 1:
        raise ValueError(f"graph_margins needs modules >= 1, got {modules}")
    host_s = modules * EAGER_CALLS_PER_GEMM * eager_call_s
    return {rows: graph_margin(host_s, s, threads) for rows, s in native_seconds.items()
            if rows <= SPLIT_TIE_MAX_ROWS}


def graph_weighted(times: dict[str, dict[int, float]],
                   margins: dict[int, float] | None = None) -> dict[str, dict[int, float]]:
    """``times`` (seconds per call, by candidate and row class) with each candidate outside
    :data:`REPLAYABLE` charged ``1 + margins[rows]`` times its time at each decode row class
    (up to :data:`SPLIT_TIE_MAX_ROWS` rows; ``margins``: :func:`graph_margins`, this CPU's and
    model's; None or a class it lacks: :data:`GRAPH_MARGIN`), when some candidate is
    replayable; else unchanged. What :func:`choose` compares when the engine's decode steps
    would replay as CPU step graphs: a non-replayable decode GEMM costs the whole step graph.
    E.g. gate_up 3072 x 576 fp32 on the quiet Zen 5, ms at 1 / 64 / 512 rows: native 0.241 /
    0.893 / 7.00, oneDNN 0.215 / 0.999 / 7.01 (1.12x faster at one row) counts as 0.253 /
    1.177 / 7.01 at :data:`GRAPH_MARGIN` (1.18x) and loses every class."""
    if not any(c in REPLAYABLE for c in times):
        return times
    margins = margins or {}
    return {c: t if c in REPLAYABLE else
            {rows: s * (1 + margins.get(rows, GRAPH_MARGIN)) if rows <= SPLIT_TIE_MAX_ROWS
             else s for rows, s in t.items()}
            for c, t in times.items()}


def model_graph_margins(weights: list[tuple[GemmShape, tuple[int, ...] | None]],
                        candidates: tuple[str, ...], timings: GemmTimings,
                        threads: int) -> dict[int, float] | None:
    """:func:`graph_margins` of a model whose GEMM modules have ``weights`` (each module's
    shape class and the row classes :func:`choose` will time it at: None for
    ``timings.rows``, an LM head's ``head_row_classes``), from the times :func:`choose` reads
    (timed here, alternating, where not cached yet) and this CPU's eager call
    (:meth:`GemmTimings.eager_call_seconds`). A row class counts the modules timed at it.
    None when ``native`` is not among ``candidates`` or no module is given (nothing
    replayable to weigh)."""
    if "native" not in candidates or len(candidates) < 2 or not weights:
        return None
    native: dict[int, float] = {}
    modules: dict[int, int] = {}
    for shape, rows in weights:
        for r, s in timings.get_all(shape, candidates, rows)["native"].items():
            native[r] = native.get(r, 0.0) + s
            modules[r] = modules.get(r, 0) + 1
    call_s = timings.eager_call_seconds()
    margins: dict[int, float] = {}
    for r, s in native.items():
        margins.update(graph_margins({r: s}, modules[r], call_s, threads))
    return margins


def choose(shape: GemmShape, candidates: tuple[str, ...], timings: GemmTimings | None,
           split: bool = False, graphs: bool = False,
           rows: tuple[int, ...] | None = None,
           margins: dict[int, float] | None = None) -> str | KernelSplit:
    """The kernel for ``shape``: the only candidate, or with ``split`` (both packings
    affordable) a :class:`KernelSplit` where the fastest changes along the row classes
    (:func:`split_candidate`), else the fastest by :func:`best_candidate`. With ``graphs``
    (the engine's decode steps would replay as CPU step graphs) the times compared are
    :func:`graph_weighted`'s, at ``margins`` (:func:`model_graph_margins`; None:
    :data:`GRAPH_MARGIN`). ``rows``: the row classes timed (default ``timings.rows``; an
    LM head's: :func:`~kvflow.kernels.gemm_timing.head_row_classes`)."""
    if len(candidates) == 1 or timings is None:
        return candidates[0]
    times = timings.get_all(shape, candidates, rows)
    if graphs:
        times = graph_weighted(times, margins)
    return (split and split_candidate(times)) or best_candidate(times)


def transformer_gemm_shapes(hf_config) -> list[tuple[int, int, int]] | None:
    """(n, k, count) of each GEMM of a dense decoder (q/k/v, o, gate/up, down per layer, the LM
    head once, last) from its HF config, or None when the config is not of that kind (MoE,
    missing sizes)."""
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


def head_candidates(dtype: torch.dtype, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels an LM head of ``dtype`` may run, of ``candidates`` (its layers'): a 16-bit
    head only ``native`` where that is one (its logits stay the fp32 accumulation; oneDNN's
    16-bit GEMM rounds them: ``pack_logits_head``), an fp32 head any."""
    return ("native",) if dtype != torch.float32 and "native" in candidates else candidates


def head_proxy(shapes: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """(n, k) of the layer shape (all of ``shapes`` but the last, the LM head:
    :func:`transformer_gemm_shapes`) whose GEMM time per output column stands for the head's:
    the widest with the head's ``k`` (a dense decoder's gate/up); None when none has it.

    Why: both read ``k``-long rows of the weight per output column, so at one row (memory
    bound: bytes per column) and at a few dozen rows (the same micro-kernels per column) a
    call's time is proportional to its columns. On a 2-core Ice Lake Xeon SmolLM2's head
    (49,152 x 576, timed on an 8,192-column slice) against gate/up (3,072 x 576), time per
    column at 1 / 64 rows: bf16 kvflow 0.103 / 0.610 against 0.108 / 0.639 us, fp32 kvflow
    0.222 / 0.618 against 0.206 / 0.607 (within 7%; docs/benchmarks.md, session 52). The
    head's own timing cost a first start 0.2 CPU s per dtype there."""
    k = shapes[-1][1]
    layers = [(n, kk) for n, kk, _ in shapes[:-1] if kk == k]
    return max(layers) if layers else None


def estimated_step_seconds(shapes: list[tuple[int, int, int]], dtype: torch.dtype,
                           candidates: tuple[str, ...], timings: GemmTimings,
                           head_rows: tuple[int, ...] | None = None,
                           graphs: bool = False) -> dict[int, float]:
    """Seconds of a forward pass's GEMMs at each row class of ``timings.rows`` with the fastest
    candidate per shape (what :func:`choose_dtype` compares). With ``head_rows`` the last of
    ``shapes`` is the LM head (:func:`transformer_gemm_shapes`): it counts only at those row
    classes (the sampled rows it gets, :func:`~kvflow.kernels.gemm_timing.head_row_classes`;
    a prefill chunk's head call has a few rows, not the chunk's) and with
    :func:`head_candidates`' kernels, its time estimated per column from
    :func:`head_proxy`'s layer shape (timed anyway; the head itself only where no layer
    shares its ``k``). With ``graphs`` each shape's times are :func:`graph_weighted`'s, as
    :func:`choose` weighs them when decode steps replay as CPU step graphs."""
    total = dict.fromkeys(timings.rows, 0.0)
    proxy = head_proxy(shapes) if head_rows is not None else None
    for i, (n, k, count) in enumerate(shapes):
        head = head_rows is not None and i == len(shapes) - 1
        rows = head_rows if head else timings.rows
        kernels = head_candidates(dtype, candidates) if head else candidates
        timed_n, timed_k = proxy if head and proxy is not None else (n, k)
        per = timings.get_all(GemmShape(timed_n, timed_k, dtype), kernels, rows)
        if graphs:
            per = graph_weighted(per)
        for r in rows:
            total[r] += count * n / timed_n * min(t[r] for t in per.values())
    return total


def choose_dtype(shapes: list[tuple[int, int, int]],
                 candidates: dict[torch.dtype, tuple[str, ...]], timings: GemmTimings,
                 head_rows: tuple[int, ...] | None = None, graphs: bool = False) -> torch.dtype:
    """The dtype (a key of ``candidates``, which maps each to its kernels) whose GEMMs run a
    forward pass of ``shapes`` fastest: lowest sum over row classes of its time relative to the
    fastest dtype's. Ties keep the first key. ``head_rows``: the LM head's row classes
    (:func:`estimated_step_seconds`; None: the head counts as a layer shape); ``graphs``:
    decode steps replay as CPU step graphs (:func:`graph_weighted`). Each layer shape's
    dtypes are timed in one alternating call (:meth:`GemmTimings.time_together`), so a change
    of load hits them alike."""
    layers = shapes[:-1] if head_rows is not None else shapes
    for n, k, _ in layers:
        timings.time_together({GemmShape(n, k, d): c for d, c in candidates.items()})
    step = {d: estimated_step_seconds(shapes, d, c, timings, head_rows, graphs)
            for d, c in candidates.items()}
    fastest = {rows: min(s[rows] for s in step.values()) for rows in timings.rows}
    return min(step, key=lambda d: sum(step[d][r] / fastest[r] for r in timings.rows))


def measure_cpu_dtype(hf_config, half: torch.dtype, choice: str,
                      onednn_packs: Callable[[torch.dtype], bool],
                      rows: tuple[int, ...] = ROW_CLASSES,
                      max_num_seqs: int | None = None, graphs: bool = False) -> torch.dtype:
    """``--dtype auto`` on a CPU: ``half`` (bf16/fp16) or float32, whichever runs the model's
    GEMMs (:func:`transformer_gemm_shapes`) faster with the kernels ``choice`` allows
    (:func:`candidates_for`: on a CPU without ``half`` matmul units, where ``onednn_packs(half)``
    is False, kvflow's own GEMM only, its weights widened in registers) (:func:`choose_dtype`,
    with ``graphs``: decode steps replay as CPU step graphs; timings cached) at the row classes
    ``rows`` (the engine's: :func:`~kvflow.kernels.gemm_timing.row_classes`), the LM head at
    those up to ``max_num_seqs`` rows (:func:`~kvflow.kernels.gemm_timing.head_row_classes`,
    as ``--cpu-gemm auto`` times it; None: at every class) with the kernels it would run
    (:func:`head_candidates`). ``half`` when the model's shapes are unknown.
    ``onednn_packs(dtype)``: whether oneDNN may pack ``dtype``."""
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
    timings = gemm_timings(kernels, rows)
    head_rows = None if max_num_seqs is None else head_row_classes(rows, max_num_seqs)
    dtype = choose_dtype(shapes, candidates, timings, head_rows, graphs)
    timings.save()
    logger.info("--dtype auto: %s (GEMMs timed in %s)", dtype,
                " and ".join(str(d) for d in candidates))
    return dtype
