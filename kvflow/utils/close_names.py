"""The closest valid name to a misspelled one (``max_token`` -> ``max_tokens``), shared by
every place that refuses an unknown name: the CLI's flags, ``--config`` file keys,
``LLM(...)`` / ``EngineConfig.from_kwargs`` keywords and the request parameter classes'
constructors (``guess_unknown_keywords``). Pure functions, no kvflow imports."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["CUTOFF", "closest_name", "did_you_mean", "guess_unknown_keywords"]

T = TypeVar("T", bound=type)

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


def guess_unknown_keywords(cls: T) -> T:
    """Class decorator for a dataclass (put it above ``@dataclass``): a keyword of its
    constructor that names no field is a TypeError naming it and the closest field,
    ``SamplingParams.__init__() got an unexpected keyword argument 'max_token' (did you mean
    'max_tokens'?)``, where the dataclass's own ``__init__`` says only the first half (a
    keyword with no close field gets that half alone; every other bad call is the
    dataclass's own TypeError). ``inspect.signature`` still shows the fields. Objects built
    without ``__init__`` (msgspec decoding, ``copy``) are not affected.

    Raises:
        TypeError: when ``cls`` is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"guess_unknown_keywords: {cls.__name__} is not a dataclass")
    init = cls.__init__
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    known = frozenset(names)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in known:
                raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword "
                                f"argument {key!r}{did_you_mean(key, names)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
