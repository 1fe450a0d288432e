"""Stop strings in incremental detokenization: the request's stop strings checked, the
occurrence that completes first found in newly decoded text, and the longest suffix that may
still grow into a stop string (or a clean-up pattern), held back until resolved.

Used by :class:`kvflow.engine.detokenizer.IncrementalDetokenizer`; its module docstring states the
contract (the earliest-completing stop wins, independent of how the text is split into tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["earliest_stop", "longest_suffix_prefix", "normalize_stops"]


def normalize_stops(stop: Sequence[str] | str | None) -> tuple[str, ...]:
    """Validate stop strings; a bare string is one stop string. Raises ValueError if empty."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return tuple(dict.fromkeys(stops))


def longest_suffix_prefix(text: str, patterns: Sequence[str], limit: int) -> int:
    """Length (<= ``limit``) of the longest suffix of ``text`` that is a proper prefix of any
    of ``patterns``; 0 when there is none."""
    best = 0
    for pattern in patterns:
        for k in range(min(len(pattern) - 1, len(text), limit), best, -1):
            if text.endswith(pattern[:k]):
                best = k
                break
    return best


def earliest_stop(region: str, stops: Sequence[str], min_end: int) -> tuple[int, str] | None:
    """Find the stop occurrence in ``region`` ending after ``min_end`` that completes first.

    Returns ``(start offset, stop string)``; ties on the end offset go to the earlier start.
    Occurrences ending at or before ``min_end`` were already searched in an earlier step.
    """
    best: tuple[int, int, str] | None = None
    for stop_str in stops:
        start = region.find(stop_str, max(0, min_end - len(stop_str) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop_str), start, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[1], best[2])
