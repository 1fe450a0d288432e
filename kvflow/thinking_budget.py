"""vLLM 0.32's ``thinking_token_budget``: the reasoning markers a request's budget is counted
and ended with (:class:`ReasoningTokenIds`, vLLM's ``ReasoningConfig`` token ids, carried by
``SamplingParams.reasoning_token_ids``), and the rule that says which token a sampling
position must take (:class:`ThinkingBudgetScan`, one per budgeted request in the runner).

The rule (vLLM's model runner V2, ``v1/worker/gpu/sample/thinking_budget.py``): before a
position is sampled, look at every token before it (prompt, generated tokens, and the draft
tokens before it under speculative decoding). The request is inside a think block when the
last ``reasoning_start_token_ids`` sequence starts after the last
``natural_reasoning_end_token_ids`` sequence; the tokens after that start marker (a prompt's
included: a template that opens the block counts what it wrote after the marker) are its
think tokens. Once there are ``budget`` of them or more, the position is forced to the next
token of ``reasoning_end_token_ids``: the first, or the one after the longest proper prefix
of it the tokens already end with (a multi-token marker is forced over successive
positions). When the marker is complete the natural end follows the start, and the request
is out of the block: nothing more is forced until a later start marker.

Everything is a function of the tokens, so preemption (the row is rebuilt from the prompt
and the generated tokens) and draft rejection (only tokens before the position are read)
need nothing of their own; the scan keeps the last markers of the tokens it has already
read, so a decode step reads only its new tokens.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ReasoningTokenIds:
    """The token ids of a model's reasoning markers (vLLM's ``ReasoningConfig`` fields:
    the strings of the server's ``--reasoning-parser`` tokenized without special tokens).

    Attributes:
        reasoning_start_token_ids: the opening marker (``<think>``).
        reasoning_end_token_ids: what is forced when the budget is spent (``</think>``).
        natural_reasoning_end_token_ids: the marker that ends reasoning when the model
            writes it (vLLM's; the end of ``reasoning_end_token_ids`` when that holds a
            transition phrase first); None: ``reasoning_end_token_ids``.

    Raises:
        ValueError: from the constructor when a marker is not a non-empty list of token ids
            (integers >= 0).
    """

    reasoning_start_token_ids: list[int]
    reasoning_end_token_ids: list[int]
    natural_reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.natural_reasoning_end_token_ids is None:
            self.natural_reasoning_end_token_ids = list(self.reasoning_end_token_ids or [])
        for name in ("reasoning_start_token_ids", "reasoning_end_token_ids",
                     "natural_reasoning_end_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0
                    for t in ids):
                raise ValueError(f"SamplingParams.reasoning_token_ids.{name}="
                                 f"{reprlib.repr(ids)} is invalid: it must be a non-empty "
                                 "list of token ids")
            setattr(self, name, [int(t) for t in ids])

    @classmethod
    def from_value(cls, value: Any) -> ReasoningTokenIds | None:
        """``value`` as a ReasoningTokenIds: None, an instance, or a dict of its fields.

        Raises:
            ValueError: for another type, or invalid markers.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"SamplingParams.reasoning_token_ids is invalid: {e}") \
                    from None
        raise ValueError(f"SamplingParams.reasoning_token_ids={reprlib.repr(value)} is "
                         "invalid: it must be a ReasoningTokenIds, a dict of its fields, "
                         "or None")


def check_thinking_token_budget(value: Any) -> int | None:
    """``thinking_token_budget`` as vLLM 0.32 reads it: None or -1 (unlimited) -> None, else
    a non-negative integer (tokens of reasoning before the end marker is forced).

    Raises:
        ValueError: for a bool, a float, another type, or an integer below -1 or above
            2**63 - 1 (it crosses to the engine as a 64-bit integer).
    """
    if value is None or (_is_int(value) and value == -1):
        return None
    if not _is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"SamplingParams.thinking_token_budget={value!r} is invalid: it "
                         "must be a non-negative integer, or -1 (unlimited)")
    return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def last_match(tokens: np.ndarray, marker: np.ndarray, start: int = 0) -> int:
    """The index in ``tokens`` (int64 [L]) where the last occurrence of ``marker`` (int64
    [M], M >= 1) that begins at or after ``start`` begins; -1 if none."""
    m = len(marker)
    if len(tokens) - start < m:
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(tokens[start:], m)
    hits = np.flatnonzero((windows == marker).all(axis=1))
    return start + int(hits[-1]) if len(hits) else -1


class ThinkingBudgetScan:
    """One budgeted request's reading of its tokens (see the module docstring).

    Args:
        budget: the request's ``thinking_token_budget`` (>= 0).
        ids: its reasoning markers.
        first: the first token index that may hold a marker (0, what the runner uses: the
            prompt counts, under a grammar too, whose matcher starts after the reasoning;
            the prompt's length: only generated tokens do).
    """

    def __init__(self, budget: int, ids: ReasoningTokenIds, first: int = 0) -> None:
        self.budget = budget
        self.start = np.asarray(ids.reasoning_start_token_ids, np.int64)
        self.natural_end = np.asarray(ids.natural_reasoning_end_token_ids, np.int64)
        self.end = list(ids.reasoning_end_token_ids)
        self.first = first
        # the last markers among tokens [first, scanned): (start index, natural end index)
        self.scanned = first
        self.last_start = self.last_end = -1
        self._overlap = max(len(self.start), len(self.natural_end)) - 1

    def _advance(self, tokens: np.ndarray, start: int, stop: int, last: tuple[int, int]
                 ) -> tuple[int, int]:
        """``last`` (start, natural end) updated with the markers that begin in
        ``[start, stop)`` and end before ``stop``."""
        window = tokens[:stop]
        found_start = last_match(window, self.start, start)
        found_end = last_match(window, self.natural_end, start)
        return (found_start if found_start >= 0 else last[0],
                found_end if found_end >= 0 else last[1])

    def commit(self, tokens: np.ndarray) -> None:
        """Read the request's known tokens ``tokens`` (int64 [L]: prompt and generated); a
        marker may straddle the previous end, so the last few tokens are read again."""
        n = len(tokens)
        if n < self.scanned:  # fewer tokens than read before: read them all again
            self.scanned, self.last_start, self.last_end = self.first, -1, -1
        begin = max(self.first, self.scanned - self._overlap)
        self.last_start, self.last_end = self._advance(tokens, begin, n,
                                                       (self.last_start, self.last_end))
        self.scanned = n

    def forced_token(self, tokens: np.ndarray, num_known: int) -> int | None:
        """The token the position after ``tokens`` (int64 [L]: the known tokens, then any
        draft tokens before the position) must take, or None. ``commit`` must have read the
        first ``num_known`` of them."""
        n = len(tokens)
        last_start, last_end = self.last_start, self.last_end
        if n > num_known:  # draft tokens: markers beginning in them (or straddling)
            begin = max(self.first, num_known - self._overlap)
            last_start, last_end = self._advance(tokens, begin, n, (last_start, last_end))
        if last_start < 0 or last_start <= last_end:
            return None
        if n - (last_start + len(self.start)) < self.budget:
            return None
        done = 0  # the longest proper prefix of the end marker the tokens end with
        for size in range(1, min(len(self.end) - 1, n) + 1):
            if tokens[n - size:].tolist() == self.end[:size]:
                done = size
        return self.end[done]
