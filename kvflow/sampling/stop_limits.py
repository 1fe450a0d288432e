"""Caps on a request's stop strings (SamplingParams.stop) and the error naming a value over
one of them, with the OpenAI error code the server answers it with."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_STOP_CHARS", "MAX_STOP_STRINGS", "LimitError", "check_stop_limits"]

# Stop strings are matched on the API process's output loop, per stop string per token (a
# search over the last ``max(len(stop))`` characters, and the held-back suffix against each
# stop's prefixes): these caps bound that work for one request (OpenAI allows 4 stops).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 256


class LimitError(ValueError):
    """A value over one of the caps above; ``code`` is the OpenAI error code the server gives
    it (``array_above_max_length`` for too many items, ``string_above_max_length`` for a
    string too long)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def check_stop_limits(stops: Sequence[str]) -> None:
    """``stops`` (``SamplingParams.stop``) holds at most ``MAX_STOP_STRINGS`` stop strings of
    at most ``MAX_STOP_CHARS`` characters (the message gives the counts, not the strings:
    they may be megabytes).

    Raises:
        LimitError: (a ValueError) naming ``SamplingParams.stop``, the limit and what was
            sent; code ``array_above_max_length`` / ``string_above_max_length``.
    """
    if len(stops) > MAX_STOP_STRINGS:
        raise LimitError(f"SamplingParams.stop holds {len(stops)} strings: at most "
                         f"{MAX_STOP_STRINGS} stop strings are accepted per request",
                         "array_above_max_length")
    for i, stop in enumerate(stops):
        if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
            raise LimitError(f"SamplingParams.stop[{i}] holds {len(stop)} characters: at "
                             f"most {MAX_STOP_CHARS} are accepted per stop string",
                             "string_above_max_length")
