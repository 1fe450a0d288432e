"""Where a constrained request's grammar starts when its reasoning markers are known
(``SamplingParams.reasoning_token_ids``, filled by the server from ``--reasoning-parser``):
vLLM 0.32's rule (``v1/structured_output``'s ``reasoning_ended``, with a think-style parser's
``is_reasoning_end`` / ``is_reasoning_end_streaming``).

- The prompt decides first: when its last natural end marker (``</think>``) comes after its
  last start marker (``<think>``), the template closed the block (thinking disabled, as
  Qwen3's ``enable_thinking: false`` writes ``<think></think>``): the grammar applies from the
  first generated token.
- Otherwise (the template opened the block, or the prompt holds no marker) the reply is
  reasoning until it writes the natural end marker: those tokens, the marker included, are
  unconstrained and never fed to the matcher; the grammar applies from the token after it.
  A reply that never writes it is never constrained (as in vLLM).

The gate is read by ``RequestStructuredOutput`` in the engine core: tokens are appended one by
one as the scheduler accepts them, and a step's draft tokens are read without being kept
(``ended_after``), so a draft that crosses the end marker is unconstrained up to it and
checked by the grammar after it. Preemption keeps the engine core's state (nothing is
recomputed here).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.thinking_budget import ReasoningTokenIds, last_match


def prompt_ends_reasoning(prompt_token_ids: Sequence[int], ids: ReasoningTokenIds) -> bool:
    """vLLM's ``is_reasoning_end`` on the prompt: True when the last natural end marker in
    ``prompt_token_ids`` begins after the last start marker (and exists)."""
    tokens = np.asarray(list(prompt_token_ids), np.int64)
    end = last_match(tokens, np.asarray(ids.natural_reasoning_end_token_ids, np.int64))
    start = last_match(tokens, np.asarray(ids.reasoning_start_token_ids, np.int64))
    return end >= 0 and end > start


class ReasoningGate:
    """One constrained request's reasoning state (see the module docstring).

    Args:
        ids: the request's reasoning markers.
        prompt_token_ids: its prompt's token ids.
    """

    def __init__(self, ids: ReasoningTokenIds, prompt_token_ids: Sequence[int]) -> None:
        self.end_marker = list(ids.natural_reasoning_end_token_ids)
        #: True once reasoning is over: the grammar reads every later token
        self.ended = prompt_ends_reasoning(prompt_token_ids, ids)
        # the last generated tokens (fewer than the end marker's length) while reasoning
        self._tail: list[int] = []

    def ended_after(self, token_ids: Sequence[int]) -> int | None:
        """How many leading ``token_ids`` (the next tokens, not kept) are reasoning: 0 when
        it is already over, ``i + 1`` when ``token_ids[i]`` completes the end marker, None
        when all of them are."""
        if self.ended:
            return 0
        tail = list(self._tail)
        size = len(self.end_marker)
        for i, token in enumerate(token_ids):
            tail.append(int(token))
            if tail[-size:] == self.end_marker:
                return i + 1
            del tail[:-(size - 1) or len(tail)]
        return None

    def append(self, token_id: int) -> bool:
        """Read one accepted reasoning token (call only while not ``ended``); True when it
        completes the end marker (``ended`` is then True: the next token is the grammar's)."""
        if self.ended_after([token_id]) is not None:
            self.ended, self._tail = True, []
            return True
        keep = len(self.end_marker) - 1
        self._tail = (self._tail + [int(token_id)])[-keep:] if keep else []
        return False
