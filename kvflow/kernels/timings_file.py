"""The JSON file a kernel choice caches its timings in (``--cpu-gemm auto``,
``--cpu-attention auto``): a flat ``{key: seconds}`` object per CPU, torch, kernel sources and
thread count, read once at start and written atomically (a temporary file renamed into
place), so a concurrent reader never sees half a file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def read_timings(path: Path) -> dict[str, float]:
    """The cached ``{key: seconds}`` of ``path``; ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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
