"""The closest valid name to a misspelled one (``max_token`` -> ``max_tokens``), shared by
every place that refuses an unknown name: the CLI's flags, ``--config`` file keys,
``LLM(...)`` / ``EngineConfig.from_kwargs`` keywords and the request parameter classes'
constructors. Pure functions, no kvflow imports."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["CUTOFF", "closest_name", "did_you_mean"]

# difflib's similarity ratio (2 * matching characters / total characters) a guess must reach:
# ``modle`` / ``model`` is 0.8, ``max_token`` / ``max_tokens`` 0.95, ``top`` / ``top_p`` 0.75
CUTOFF = 0.75


def closest_name(name: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` closest to ``name`` (``difflib.get_close_matches``' best with
    a ratio >= ``CUTOFF``), or None when none is close."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=CUTOFF)
    return close[0] if close else None


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the closest of ``names`` to ``name``, or ``''``."""
    guess = closest_name(name, names)
    return f" (did you mean {guess!r}?)" if guess is not None else ""
