"""The JSON file a kernel choice caches its timings in (``--cpu-gemm auto``,
``--cpu-attention auto``): a flat ``{key: seconds}`` object per CPU, torch, kernel sources and
thread count, read once at start and written atomically (a temporary file renamed into
place), so a concurrent reader never sees half a file."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def read_timings(path: Path, warn: bool = True) -> dict[str, float]:
    """The cached ``{key: seconds}`` of ``path``: ``{}`` when it is missing or unreadable,
    and only its valid entries (a finite number of seconds above 0) when it is damaged. A
    damaged file (not JSON, not an object, or an entry that is not a time: a truncated
    write, an edit) is named in a warning, not raised: what it lacks is measured again and
    the file rewritten, as for a missing one (such a value reaching the choice would fail
    there on a string or ``null``, or divide by zero on 0 seconds). ``warn=False`` reads
    without the warning (a second read of a file already warned about)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    valid, problem = _valid_seconds(text)
    if problem is not None and warn:
        logger.warning("ignoring %s of the timings file %s: measuring again", problem, path)
    return valid


def _valid_seconds(text: str) -> tuple[dict[str, float], str | None]:
    """The valid ``{key: seconds}`` entries of a timings file's ``text`` and what was wrong
    with the rest (None when nothing was)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        return {}, f"the content (not JSON: {exc})"
    if not isinstance(data, dict):
        kind = {type(None): "null", list: "array", str: "string", bool: "boolean"}.get(
            type(data), "number")
        return {}, f"the content (a JSON {kind}, not an object of seconds)"
    valid = {key: float(value) for key, value in data.items() if _is_seconds(value)}
    if len(valid) == len(data):
        return valid, None
    bad = next(key for key in data if key not in valid)
    return valid, (f"{len(data) - len(valid)} of {len(data)} entries (e.g. {bad!r}: "
                   f"{data[bad]!r}, not seconds above 0)")


def _is_seconds(value: object) -> bool:
    """Whether a JSON value is a time a kernel took: a finite number above 0 (not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an integer too large for a float
        return False


def write_timings(path: Path, seconds: dict[str, float], what: str) -> bool:
    """Write ``seconds`` to ``path`` atomically; returns whether it was written. A failure is
    logged as a warning naming ``what`` (e.g. "GEMM timings"), not raised: the engine runs on
    without the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(seconds, indent=0, sort_keys=True))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.warning("could not cache %s in %s: %s", what, path, exc)
        return False
