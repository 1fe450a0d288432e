"""StructuredOutputManager: grammars for the engine core, compiled off the step loop.

Life of a constrained request in the engine core:

1. ``add_request`` (when the request arrives): the compile is submitted to a worker thread
   (or found in the cache by ``params.key``); the request carries a ``RequestStructuredOutput``.
   The scheduler does not admit it while ``is_ready`` is False, so a compile never stalls a
   step.
2. Each step, ``grammar_bitmask`` fills one bitmask row per constrained request that samples
   (``k + 1`` rows for one verifying ``k`` draft tokens: the matcher accepts the drafts one by
   one, a row after each, and is rolled back); the sampler masks those rows only.
3. ``Scheduler.update_from_output`` feeds each sampled token to the request's matcher before
   appending it. A token the grammar rejects (only possible when the grammar admits nothing
   more) ends the request with ``length``; a token that terminates the grammar (the EOS after a
   complete match) ends it with ``stop``, also under ``ignore_eos`` (nothing may follow it).

Preemption needs no rollback: recompute only recomputes K/V for tokens the matcher has already
accepted, and the next sample continues after all of them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from kvflow.request import Request
from kvflow.sched_output import GrammarBitmask
from kvflow.structured.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvflow.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (LRU)


class RequestStructuredOutput:
    """A request's constraint: its compile future, then its matcher (made on first use)."""

    def __init__(self, future: Future, new_matcher: Callable[[Any], StructuredOutputGrammar]
                 ) -> None:
        self._future = future
        self._new_matcher = new_matcher
        self._matcher: StructuredOutputGrammar | None = None

    @property
    def is_ready(self) -> bool:
        """True once compilation finished (successfully or not): the request may be scheduled."""
        return self._future.done()

    @property
    def matcher(self) -> StructuredOutputGrammar | None:
        """The matcher, or None if compilation failed. Call only when ``is_ready``."""
        if self._matcher is None and self._future.exception() is None:
            self._matcher = self._new_matcher(self._future.result())
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher; False if the grammar rejects the token (or failed to compile)."""
        matcher = self.matcher
        return matcher is not None and matcher.accept_tokens([token_id])

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token (the EOS) was accepted: the
        grammar admits no further token."""
        matcher = self.matcher
        return matcher is not None and matcher.is_terminated()

    def num_valid_drafts(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` (speculative decoding's draft tokens) the grammar
        accepts from its current state; the matcher is rolled back to that state."""
        matcher = self.matcher
        if matcher is None:
            return 0
        num = 0
        for token_id in token_ids:
            if matcher.is_terminated() or not matcher.accept_tokens([token_id]):
                break
            num += 1
        if num:
            matcher.rollback(num)
        return num


class StructuredOutputManager:
    """Owns the grammar backend (built lazily, on the worker thread, at the first constrained
    request), the compile cache and the per-step bitmask.

    Args:
        make_backend: builds the backend (loads the tokenizer; may take a second or two).
        vocab_size: the model's logits width (tokens).
        max_num_seqs: most rows a step can sample (bitmask buffer size).
    """

    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], vocab_size: int,
                 max_num_seqs: int) -> None:
        self._make_backend = make_backend
        self.vocab_size = vocab_size
        self._backend: StructuredOutputBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._max_num_seqs = max_num_seqs
        self._bitmask: torch.Tensor | None = None

    def request_state(self, params: StructuredOutputsParams) -> RequestStructuredOutput:
        """Start (or reuse) the compile of ``params``; returns the request's state."""
        key = params.key
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvflow-grammar")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return RequestStructuredOutput(future, lambda compiled: self._backend.new_matcher(compiled))

    def _compile(self, params: StructuredOutputsParams) -> Any:
        try:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend.compile(params)
        except Exception:
            logger.exception("structured output: compiling %s failed", params.kind)
            raise

    def grammar_bitmask(self, request_ids: list[str], requests: dict[str, Request],
                        spec_tokens: dict[str, list[int]] | None = None
                        ) -> GrammarBitmask | None:
        """One bitmask row per constrained request that samples this step (``request_ids``,
        the step's ``structured_output_request_ids``); None if none does. Requests that
        finished meanwhile are skipped. A request verifying draft tokens (``spec_tokens``,
        already cut to what its grammar accepts) gets one more row after each of them.

        A request whose grammar failed to compile gets a row allowing nothing, so its first
        token is rejected and it ends with ``length`` (it never runs unconstrained).
        """
        if self._executor is None or not request_ids:  # no constrained request this step
            return None
        rows = []
        for rid in request_ids:
            request = requests.get(rid)
            if request is not None and request.structured_output is not None:
                rows.append((rid, request.structured_output))
        if not rows:
            return None
        drafts = [(spec_tokens or {}).get(rid, ()) for rid, _ in rows]
        num_rows = len(rows) + sum(len(d) for d in drafts)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty((max(self._max_num_seqs, num_rows),
                                         (self.vocab_size + 31) // 32), dtype=torch.int32)
        row, row_ids = 0, []
        for (rid, state), tokens in zip(rows, drafts):
            self._fill_rows(state.matcher, tokens, row)
            row_ids.extend([rid] * (len(tokens) + 1))
            row += len(tokens) + 1
        return GrammarBitmask(row_ids, self._bitmask[:num_rows])

    def _fill_rows(self, matcher: StructuredOutputGrammar | None, drafts: list[int],
                   row: int) -> None:
        """Rows ``row .. row + len(drafts)``: what may follow each prefix of ``drafts``
        (nothing for a grammar that failed to compile or a draft it rejects)."""
        accepted = 0
        for i in range(len(drafts) + 1):
            if matcher is None or accepted < i:
                self._bitmask[row + i].zero_()
                continue
            matcher.fill_bitmask(self._bitmask, row + i)
            if i < len(drafts) and matcher.accept_tokens([drafts[i]]):
                accepted += 1
        if matcher is not None and accepted:
            matcher.rollback(accepted)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds for a running compile (no-op when none runs)."""
        pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
