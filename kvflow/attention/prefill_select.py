"""Choosing the CPU prefill attention of a batch of whole prompts by timing it on this CPU
(``--cpu-attention auto``).

A batch of whole prompts of one length (the common offline prefill; ``uniform_prompts``) can
attend in kvflow's native prefill tiles over the paged cache (``csrc/cpu_attention_tiled.h``,
``cpu_attention_dp.h``) or in torch's SDPA over the prompts' own contiguous K/V (oneDNN's
flash attention). Which is faster depends on the CPU: on a 2-core AVX512-BF16 EPYC the tiles
took 0.3-0.6x SDPA's time, on a 2-core Xeon with AMX they took 1.3-3.3x it in bf16 (SDPA's
bf16 products run on AMX tiles, the native tiles' VDPBF16PS at half the fp32 FMA rate there;
issue 23, docs/benchmarks.md). So each (dtype, GQA group, head_dim) is timed with both at
every prompt-length class (:data:`LENGTH_CLASSES`) the first time a batch of whole prompts
needs it, and each class gets the faster one; the timings are cached in
``<cache_dir>/cpu_attention/`` per CPU model and flags, torch, kernel sources and thread count,
so later starts measure nothing.

Timing method (as :mod:`kvflow.kernels.gemm_select`'s): one thread, process CPU time (which
other processes on a shared machine barely change), the candidates' passes alternating (A, B,
A, B, ...) and the minimum of :data:`REPEATS` each, on :data:`CLASS_TOKENS` tokens per call of
one KV head (both candidates' work is linear in the KV heads; the group's query heads are
kept): 16 prompts of 128 tokens, 4 of 512, 1 of 2,048. SmolLM2-135M's shape (group 3, 64-dim
heads) takes about half a second, once per CPU.

``--deterministic`` never asks: its batch-invariant attention has no whole-prompt shortcut.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.config import cache_dir, cpu_attention_choice
from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.cpu_timing import CachedTimings, alternating_cpu_seconds
from kvflow.kernels.gemm_timing_cache import cache_key

logger = logging.getLogger(__name__)

CANDIDATES = ("native", "sdpa")
LENGTH_CLASSES = (128, 512, 2048)  # prompt tokens; a length takes its nearest class (log scale)
CLASS_TOKENS = 2048  # tokens per timed call (prompts of the class's length)
REPEATS = 4
BLOCK_SIZE = 16
# part of the cache key: timings taken another way are redone
TIMING_METHOD = (f"prefill-attention|cpu-time-1-thread|alternating-{REPEATS}|one-kv-head|"
                 f"lengths {LENGTH_CLASSES}|tokens {CLASS_TOKENS}")


@dataclass(frozen=True)
class PrefillShape:
    """Attention of ``group`` query heads per KV head of ``head_dim`` in ``dtype``."""

    dtype: torch.dtype
    group: int
    head_dim: int

    def key(self, candidate: str, length: int) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}|g{self.group}|d{self.head_dim}|"
                f"{candidate}|{length}")


def length_class(tokens: int) -> int:
    """The class of LENGTH_CLASSES nearest to a prompt of ``tokens`` tokens on a log scale
    (boundaries at the geometric midpoints: up to 255 tokens -> 128, 256-1,023 -> 512, longer
    -> 2,048)."""
    for low, high in itertools.pairwise(LENGTH_CLASSES):
        if tokens < math.isqrt(low * high):
            return low
    return LENGTH_CLASSES[-1]


def _uniform_meta(num_reqs: int, length: int) -> AttentionMetadata:
    """Metadata of ``num_reqs`` whole prompts of ``length`` tokens in consecutive blocks."""
    blocks = -(-length // BLOCK_SIZE)
    table = torch.arange(num_reqs * blocks, dtype=torch.int32).view(num_reqs, blocks)
    slots = (table.long().unsqueeze(-1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE))
    return AttentionMetadata(
        slot_mapping=slots.view(num_reqs, -1)[:, :length].reshape(-1),
        query_start_loc=torch.arange(0, (num_reqs + 1) * length, length, dtype=torch.int32),
        seq_lens=torch.full((num_reqs,), length, dtype=torch.int32), block_table=table,
        max_query_len=length, max_seq_len=length, num_actual_tokens=num_reqs * length)


def prefill_inputs(shape: PrefillShape, length: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              AttentionMetadata]:
    """(q, k, v, kv_cache, meta) of :data:`CLASS_TOKENS` tokens (whole prompts of ``length``,
    at least one) of one KV head of ``shape``: q [T, group, D], k/v [T, 1, D] views of one fused
    qkv row per token (as the model's projections give them), the paged cache
    [2, blocks, BLOCK_SIZE, 1, D] holding k/v at ``meta.slot_mapping``."""
    num_reqs = max(1, CLASS_TOKENS // length)
    meta = _uniform_meta(num_reqs, length)
    g, d, n = shape.group, shape.head_dim, meta.num_actual_tokens
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (g + 2) * d, generator=gen).to(shape.dtype)
    q, k, v = (qkv[:, a * d:b * d].view(n, b - a, d)
               for a, b in ((0, g), (g, g + 1), (g + 1, g + 2)))
    cache = torch.zeros(2, meta.block_table.numel(), BLOCK_SIZE, 1, d, dtype=shape.dtype)
    for i, x in enumerate((k, v)):
        cache[i].view(-1, 1, d).index_copy_(0, meta.slot_mapping, x)
    return q, k, v, cache, meta


def prefill_calls(shape: PrefillShape, length: int, kernels: NativeCpuKernels
                  ) -> dict[str, Callable[[], torch.Tensor]]:
    """candidate -> a call attending :func:`prefill_inputs` as the ``cpu`` backend would:
    ``native`` reads K/V from the paged cache, ``sdpa`` from the k/v views."""
    from kvflow.attention.torch_paged import TorchPagedAttentionBackend

    q, k, v, cache, meta = prefill_inputs(shape, length)
    scale = shape.head_dim ** -0.5
    return {"native": lambda: kernels.paged_attention(
                q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale,
                validate=False),
            "sdpa": lambda: TorchPagedAttentionBackend.uniform_prompt_attention(
                q, k, v, meta, scale)}


def time_prefill(shape: PrefillShape, length: int, kernels: NativeCpuKernels
                 ) -> dict[str, float]:
    """CPU seconds per call of each candidate of :func:`prefill_calls` on one thread: the
    minimum over REPEATS passes, the candidates alternating, after one warm-up call each."""
    return alternating_cpu_seconds(lambda: prefill_calls(shape, length, kernels), REPEATS)


class PrefillTimings(CachedTimings):
    """Seconds per timed call by (shape, candidate, length class), measured on demand by
    ``measure`` (default :func:`time_prefill`) and cached
    (:class:`kvflow.kernels.cpu_timing.CachedTimings`)."""

    def __init__(self, path: Path, kernels: NativeCpuKernels | None,
                 measure: Callable[[PrefillShape, int, NativeCpuKernels | None],
                                   dict[str, float]] | None = None) -> None:
        super().__init__(path, kernels, measure or time_prefill, CANDIDATES, LENGTH_CLASSES,
                         "attention timings")

    def get(self, shape: PrefillShape) -> dict[int, dict[str, float]]:
        """length class -> candidate -> seconds per call, timing the missing classes."""
        if self.measure_missing(shape):
            logger.info("timed CPU prefill attention in %.2f s (cached in %s)",
                        self.measuring_s, self.path)
        return {n: {c: self.seconds[shape.key(c, n)] for c in CANDIDATES}
                for n in LENGTH_CLASSES}


def prefill_timings(kernels: NativeCpuKernels) -> PrefillTimings:
    """The timings cache of this CPU, torch, kernel sources and thread count, under
    ``<cache_dir>/cpu_attention/``."""
    key = cache_key(torch.get_num_threads(), kernels.isa, TIMING_METHOD)
    return PrefillTimings(Path(cache_dir()) / "cpu_attention" / f"{key}.json", kernels)


class PrefillAttentionChoice:
    """Which attention a batch of whole prompts takes (one per attention backend).

    Args:
        choice: ``auto`` (timed, see the module doc), ``native`` or ``sdpa`` (forced;
            :func:`kvflow.config.cpu_attention_choice` reads ``--cpu-attention``).
        timings: the timings ``auto`` decides by (None: made on first need by
            :func:`prefill_timings`).
        kernels: the native kernels timed (for the default timings).
    """

    def __init__(self, choice: str, kernels: NativeCpuKernels | None = None,
                 timings: PrefillTimings | None = None) -> None:
        cpu_attention_choice(choice)  # a ValueError for anything but auto / native / sdpa
        self.choice, self.kernels, self.timings = choice, kernels, timings
        self._picked: dict[tuple[PrefillShape, int], str] = {}

    def pick(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             prompt_len: int) -> str:
        """``native`` or ``sdpa`` for whole prompts of ``prompt_len`` tokens with ``num_heads``
        query and ``num_kv_heads`` KV heads of ``head_dim``: the forced choice, else the faster
        at the length's class (:func:`length_class`; a tie keeps ``native``)."""
        if self.choice != "auto":
            return self.choice
        shape = PrefillShape(dtype, num_heads // num_kv_heads, head_dim)
        key = (shape, length_class(prompt_len))
        if key not in self._picked:
            if self.timings is None:
                self.timings = prefill_timings(self.kernels)
            for length, secs in self.timings.get(shape).items():
                self._picked[(shape, length)] = min(CANDIDATES, key=secs.__getitem__)
            logger.info("CPU prefill attention (%s, group %d, head_dim %d), by prompt length "
                        "class: %s", dtype, shape.group, head_dim,
                        {n: self._picked[(shape, n)] for n in LENGTH_CLASSES})
        return self._picked[key]
