"""vLLM 0.32's ``repetition_detection``: a request whose generated tokens end with an n-gram
repeated ``min_count`` times in a row (n from ``min_pattern_size`` to ``max_pattern_size``)
finishes with reason ``repetition`` (stop reason ``"repetition_detected"``), as vLLM's
``check_sequence_repetition`` (``vllm/v1/core/sched/utils.py``) ends it. Only the generated
tokens are searched, after ``min_tokens`` are out, and after EOS, stop ids and the length
limit (which win when the same token hits them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The stop reason of a request finished by a repetition (vLLM 0.32's; finish reason
# "repetition": RequestStatus.FINISHED_REPETITION).
REPETITION_STOP_REASON = "repetition_detected"


@dataclass
class RepetitionDetectionParams:
    """When a generated token sequence counts as repeating (vLLM's fields and rules).

    Attributes:
        max_pattern_size: longest n-gram (tokens) looked for; 0 turns detection off.
        min_pattern_size: shortest n-gram (tokens) looked for; 0 means 1; at most
            ``max_pattern_size``.
        min_count: how many times in a row the n-gram must end the output (>= 2 whenever
            ``max_pattern_size`` > 0).

    Raises:
        ValueError: naming ``repetition_detection`` and the field when a size is not an
            integer >= 0, ``min_pattern_size`` > ``max_pattern_size``, or detection is on
            with ``min_count`` < 2 (vLLM's ``RepetitionDetectionParams`` checks).
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"repetition_detection.{name}={value!r} is invalid: it must "
                                 "be an integer >= 0")
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(f"repetition_detection.min_pattern_size={self.min_pattern_size} "
                             f"is invalid: it must be <= max_pattern_size "
                             f"({self.max_pattern_size}); set both to 0 to turn detection off")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count={self.min_count} is invalid: "
                             "it must be >= 2 (a pattern seen twice or more in a row) while "
                             "max_pattern_size > 0; set max_pattern_size to 0 to turn "
                             "detection off")

    @property
    def enabled(self) -> bool:
        """Whether any pattern is looked for (``max_pattern_size`` > 0)."""
        return self.max_pattern_size > 0

    @classmethod
    def from_value(cls, value: object) -> RepetitionDetectionParams | None:
        """``value`` as parameters: None, an instance, or a dict of its fields.

        Raises:
            ValueError: naming ``repetition_detection`` for any other value, an unknown
                key, or an invalid field (see the class).
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"repetition_detection={value!r} is invalid: it must be an "
                "object with max_pattern_size, min_pattern_size and min_count")
        unknown = sorted(set(value) - {"max_pattern_size", "min_pattern_size", "min_count"})
        if unknown:
            raise ValueError(f"repetition_detection.{unknown[0]} is not a field (the fields "
                             "are max_pattern_size, min_pattern_size and min_count)")
        return cls(**value)


def ends_with_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether ``token_ids`` (the generated tokens) end with an n-gram repeated
    ``params.min_count`` times in a row, for some n in ``[min_pattern_size or 1,
    max_pattern_size]``: ``token_ids[-n*k:]`` is the last n tokens ``k = min_count`` times."""
    if not params.enabled:
        return False
    count = params.min_count
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if size * count > len(token_ids):
            return False
        tail = token_ids[-size:]
        if all(token_ids[-size * (k + 1):len(token_ids) - size * k] == tail
               for k in range(1, count)):
            return True
    return False
