"""The cache of the CPU GEMM timings (:mod:`kvflow.kernels.gemm_timing` times them): seconds
per call by shape class, candidate kernel and rows in ``<cache_dir>/cpu_gemm/<key>.json``, the
key (:func:`cache_key`) covering the CPU model and flags, torch version, kernel sources,
thread count and timing method, so the next start measures nothing. The timing functions are
called through the :mod:`~kvflow.kernels.gemm_timing` module (tests replace them there).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from kvflow.config import cache_dir
from kvflow.kernels import cpu_build, gemm_timing
from kvflow.kernels.cpu_native import NativeCpuKernels
from kvflow.kernels.gemm_timing import GemmShape
from kvflow.kernels.timings_file import read_timings, write_timings

logger = logging.getLogger(__name__)


def cache_key(num_threads: int, isa: str = "", method: str | None = None) -> str:
    """What the timings depend on: the CPU model and flags, torch, kvflow's kernel sources,
    the ISA level of the loaded kernels, the thread count and how they are measured
    (``method``: another kernel's timings name theirs; default: ``gemm_timing.timing_method``
    of ``timing_pool_bytes``, so a CPU with another cache size is timed again)."""
    method = (gemm_timing.timing_method(gemm_timing.timing_pool_bytes()) if method is None
              else method)
    digest = hashlib.sha256()
    csrc = Path(cpu_build.__file__).parent / "csrc"
    for part in [cpu_build.cpu_fingerprint(), torch.__version__, str(num_threads), isa,
                 method,
                 *(p.read_text() for p in sorted(csrc.glob("*.[ch]")))]:
        digest.update(part.encode())
    return digest.hexdigest()[:16]


class GemmTimings:
    """Seconds per GEMM call by (shape class, candidate, rows), measured on demand at the row
    classes ``rows`` (default ``gemm_timing.ROW_CLASSES``; an engine's:
    ``gemm_timing.row_classes``) and cached in a JSON file. One engine start at a time writes
    it (rename into place)."""

    def __init__(self, path: Path, kernels: NativeCpuKernels | None,
                 rows: tuple[int, ...] = gemm_timing.ROW_CLASSES) -> None:
        self.path, self.kernels, self.rows = path, kernels, tuple(rows)
        self.seconds: dict[str, float] = read_timings(path)
        self._dirty = False
        self.measuring_s = 0.0  # spent timing kernels in this process

    def get(self, shape: GemmShape, candidate: str,
            rows: tuple[int, ...] | None = None) -> dict[int, float]:
        """Seconds per call of ``candidate`` on ``shape`` at each row class of ``rows``
        (default ``self.rows``; e.g. an LM head's, which only gets the sampled rows), scaled
        to the full ``n`` of a sliced (wide) shape."""
        keys = {r: shape.key(candidate, r) for r in (self.rows if rows is None else rows)}
        missing = [r for r, key in keys.items() if key not in self.seconds]
        if missing:
            start = time.perf_counter()
            measured = gemm_timing.time_candidate(shape, candidate, missing, self.kernels)
            self.measuring_s += time.perf_counter() - start
            self.seconds.update({keys[r]: s for r, s in measured.items()})
            self._dirty = True
        return {r: self.seconds[key] * shape.n / shape.timed_cols(r) for r, key in keys.items()}

    def get_all(self, shape: GemmShape, candidates: Iterable[str],
                rows: tuple[int, ...] | None = None) -> dict[str, dict[int, float]]:
        """:meth:`get` of each candidate at ``rows`` (default ``self.rows``); those not cached
        yet are timed together, their passes alternating (:meth:`time_together`)."""
        candidates = tuple(candidates)
        self.time_together({shape: candidates}, rows)
        return {c: self.get(shape, c, rows) for c in candidates}

    def time_together(self, by_shape: dict[GemmShape, tuple[str, ...]],
                      rows: tuple[int, ...] | None = None) -> None:
        """Time, in one alternating call, each (shape, candidate) of ``by_shape`` (shapes of
        one ``n x k``, e.g. in bf16 and fp32: ``gemm_timing.time_dtypes``) not cached at every row
        class of ``rows`` (default ``self.rows``), at the classes some of them lacks; nothing
        when fewer than two pairs lack one (:meth:`get` times a lone one)."""
        rows = self.rows if rows is None else tuple(rows)
        lacks = lambda s, c: any(s.key(c, r) not in self.seconds for r in rows)
        missing = {s: tuple(c for c in cands if lacks(s, c)) for s, cands in by_shape.items()}
        missing = {s: cands for s, cands in missing.items() if cands}
        if sum(map(len, missing.values())) < 2:
            return
        # only the rows some pair lacks: a 2,048-row class is timed on a column slice
        # (GemmShape.timed_cols) that shapes of one k share, so another shape has it already
        need = [r for r in rows
                if any(s.key(c, r) not in self.seconds for s, cs in missing.items() for c in cs)]
        start = time.perf_counter()
        if len(missing) == 1:
            (shape, cands), = missing.items()
            measured = {shape: gemm_timing.time_candidates(shape, cands, need, self.kernels)}
        else:
            measured = gemm_timing.time_dtypes(missing, need, self.kernels)
        self.measuring_s += time.perf_counter() - start
        for s, by_cand in measured.items():
            for c, secs in by_cand.items():
                self.seconds.update({s.key(c, r): t for r, t in secs.items()})
        self._dirty = True

    def eager_call_seconds(self) -> float:
        """:func:`~kvflow.kernels.gemm_timing.eager_call_seconds` of this CPU: cached under
        ``gemm_timing.EAGER_CALL_KEY``, measured (~20 ms) where missing.

        Raises:
            ValueError: when kvflow's kernels are not loaded (``kernels`` None): without them
                no step graph replays, so there is no saving to weigh.
        """
        if gemm_timing.EAGER_CALL_KEY not in self.seconds:
            if self.kernels is None:
                raise ValueError("eager_call_seconds needs kvflow's native kernels "
                                 "(GemmTimings.kernels is None)")
            start = time.perf_counter()
            self.seconds[gemm_timing.EAGER_CALL_KEY] = gemm_timing.eager_call_seconds(
                self.kernels)
            self.measuring_s += time.perf_counter() - start
            self._dirty = True
        return self.seconds[gemm_timing.EAGER_CALL_KEY]

    def save(self) -> None:
        """Write new timings (atomically); a failure to write is logged, not raised."""
        if not self._dirty:
            return
        logger.info("timed CPU GEMM kernels in %.2f s (cached in %s)", self.measuring_s,
                    self.path)
        if write_timings(self.path, self.seconds, "GEMM timings"):
            self._dirty = False


def gemm_timings(kernels: NativeCpuKernels | None,
                 rows: tuple[int, ...] = gemm_timing.ROW_CLASSES) -> GemmTimings:
    """The timings cache of this CPU, torch, kernel sources, thread count and row classes
    (``rows``: an engine's, ``gemm_timing.row_classes``), under ``<cache_dir>/cpu_gemm/``."""
    method = gemm_timing.timing_method(gemm_timing.timing_pool_bytes(), rows)
    name = f"{cache_key(torch.get_num_threads(), kernels.isa if kernels else '', method)}.json"
    return GemmTimings(Path(cache_dir()) / "cpu_gemm" / name, kernels, rows)
