"""One request's grammar constraint in the engine core: its compile future, then its matcher
(made at first use), and the error its matcher raised, if it did (the scheduler then ends the
request alone with it: ``kvflow/core/sched_failures.py``). ``StructuredOutputManager``
(``kvflow/structured/manager.py``) makes them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvflow.core.request_errors import STRUCTURED_OUTPUTS
from kvflow.runner_output import RequestFailure
from kvflow.structured.backend import StructuredOutputGrammar
from kvflow.structured.reasoning_gate import ReasoningGate
from kvflow.worker.request_failures import failure_of, is_request_fault

logger = logging.getLogger(__name__)


class RequestStructuredOutput:
    """A request's constraint: its compile future, then its matcher (made on first use).

    Args:
        future: the grammar's compile.
        new_matcher: makes the matcher from the compiled grammar.
        check_first_step: not ready until the manager checked the first step.
        reasoning: the request's reasoning gate (``structured/reasoning_gate.py``: tokens
            before the reasoning end marker are unconstrained and not fed to the matcher);
            None: the grammar applies from the first token.
    """

    def __init__(self, future: Future, new_matcher: Callable[[Any], StructuredOutputGrammar],
                 check_first_step: bool = False, reasoning: ReasoningGate | None = None
                 ) -> None:
        self._future = future
        self.reasoning = reasoning
        self._new_matcher = new_matcher
        self._matcher: StructuredOutputGrammar | None = None
        # why its matcher failed (an exception while advancing it or filling its bitmask
        # row); the scheduler then ends the request with it (core/sched_failures.py)
        self.error: RequestFailure | None = None
        # not ready until the manager has checked that the grammar's first step allows a
        # token (one of the request's allowed_token_ids) (``_take_disjoint_first_steps``)
        self.first_step_unchecked = check_first_step

    @property
    def is_compiled(self) -> bool:
        """True once the grammar compiled (False while it compiles, or if it failed)."""
        future = self._future
        return future.done() and not future.cancelled() and future.exception() is None

    @property
    def is_ready(self) -> bool:
        """True once the grammar compiled and its first step was checked (it allows a token,
        one of the request's ``allowed_token_ids`` if it has them): the request may be
        scheduled. A compile that failed or timed out, or a first step that allows no
        token, leaves it False: the
        engine core ends such a request (``StructuredOutputManager.take_failed``) before it
        is ever scheduled."""
        return self.is_compiled and not self.first_step_unchecked

    @property
    def matcher(self) -> StructuredOutputGrammar | None:
        """The matcher, or None if compilation failed. Call only when ``is_ready``."""
        if self._matcher is None and not self._future.cancelled() and \
                self._future.exception() is None:
            self._matcher = self._new_matcher(self._future.result())
        return self._matcher

    @property
    def in_reasoning(self) -> bool:
        """True while the request's tokens are reasoning (not the grammar's yet)."""
        return self.reasoning is not None and not self.reasoning.ended

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher (or, while reasoning, the reasoning gate: always True); False
        if the grammar rejects the token (or failed to compile), or if the matcher failed
        (raised now or before: ``error`` says why).

        Raises:
            MemoryError / torch.OutOfMemoryError: out of memory (the engine's fault).
        """
        if self.in_reasoning:
            self.reasoning.append(token_id)
            return True
        matcher = self.matcher
        if matcher is None or self.error is not None:
            return False
        try:
            return matcher.accept_tokens([token_id])
        except Exception as e:  # noqa: BLE001 - this request's matcher: its failure alone
            self.fail("advancing its grammar", e)
            return False

    def fail(self, what: str, error: Exception) -> None:
        """Record that the matcher raised ``error`` while ``what``; re-raised when it is not
        the request's to bear (``request_failures.is_request_fault``)."""
        if not is_request_fault(error):
            raise error
        if self.error is None:
            logger.warning("structured output: the matcher raised while %s", what,
                           exc_info=error)
            self.error = failure_of(what, error, STRUCTURED_OUTPUTS)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token (the EOS) was accepted: the
        grammar admits no further token (never while reasoning)."""
        if self.in_reasoning:
            return False
        matcher = self.matcher
        return matcher is not None and matcher.is_terminated()

    def num_valid_drafts(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` (speculative decoding's draft tokens) the grammar
        accepts from its current state (those up to the reasoning end marker, if it is
        still reasoning, all pass); the matcher is rolled back to that state."""
        free = self.reasoning.ended_after(token_ids) if self.reasoning is not None else 0
        if free is None:
            return len(token_ids)
        matcher = self.matcher
        if matcher is None:
            return free
        num = 0
        for token_id in token_ids[free:]:
            if matcher.is_terminated() or not matcher.accept_tokens([token_id]):
                break
            num += 1
        if num:
            matcher.rollback(num)
        return free + num
