"""StructuredOutputManager: grammars for the engine core, compiled off the step loop.

Life of a constrained request in the engine core:

1. ``add_request`` (when the request arrives): the compile is submitted to the compile pool
   (``compile_pool.CompilePool``: ``structured_output_compile_threads`` threads) or found in
   the cache by ``params.key``; the request carries a ``RequestStructuredOutput``. The
   scheduler does not admit it while ``is_ready`` is False, so a compile never stalls a
   step. A compile that runs past ``structured_output_compile_timeout`` is abandoned (its
   slot goes to the next compile; its thread finishes in the background); at the start of
   each step ``take_failed`` names the waiting requests whose compile timed out or raised,
   and the engine core ends them with that error (they never held KV blocks). A timed-out
   grammar stays in the cache as failed: identical requests are refused at once instead of
   each burning a thread for the whole limit (until the entry leaves the LRU cache). A
   compile that raised is retried by the next identical request, as before.
2. Each step, ``grammar_bitmask`` fills one bitmask row per constrained request that samples
   (``k + 1`` rows for one verifying ``k`` draft tokens: the matcher accepts the drafts one by
   one, a row after each, and is rolled back; rows after a draft it rejects allow nothing, and
   that draft is rejected by the verification, whose target row gives it no probability); the
   sampler masks those rows only. A draft model's drafts are filled in by the runner, so for
   them this runs between the runner's proposal and its sampling (``engine_steps.
   execute_with_grammar``).
3. ``Scheduler.update_from_output`` feeds each sampled token to the request's matcher before
   appending it. A token the grammar rejects (only possible when the grammar admits nothing
   more) ends the request with ``length``; a token that terminates the grammar (the EOS after a
   complete match) ends it with ``stop``, also under ``ignore_eos`` (nothing may follow it).

Preemption needs no rollback: recompute only recomputes K/V for tokens the matcher has already
accepted, and the next sample continues after all of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from kvflow.request import Request
from kvflow.sched_output import GrammarBitmask
from kvflow.structured.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvflow.structured.compile_pool import CompilePool, CompileTimeoutError
from kvflow.structured.params import StructuredOutputsParams
from kvflow.structured.reasoning_gate import ReasoningGate
from kvflow.structured.request_state import RequestStructuredOutput

__all__ = ["RequestStructuredOutput", "StructuredOutputManager"]

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (LRU)
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
               "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def _first_step_problem(bitmask: torch.Tensor, allowed: list[int] | None,
                        what: str) -> str | None:
    """Why a grammar's first step leaves no token to sample, or None when it leaves some.

    Args:
        bitmask: int32 [ceil(vocab / 32)]: the grammar's first-step mask (bit ``t % 32`` of
            word ``t // 32`` set when token ``t`` may come first; a grammar that accepts
            the empty text allows its stop token).
        allowed: the request's ``SamplingParams.allowed_token_ids`` (None: every token).
        what: the constraint's name in the message ("regex", "JSON schema", ...).
    """
    if not bitmask.any():
        return (f"the {what} matches no text: no token can begin it (every first token is "
                f"masked, so the request would end with no output)")
    if allowed is None:
        return None
    ids = torch.tensor(allowed, dtype=torch.int64)
    if ((bitmask[ids // 32] >> (ids % 32)) & 1).any():
        return None
    return (f"SamplingParams.allowed_token_ids allows none of the tokens the {what} can "
            f"start with: no output could satisfy both; allow a token that can begin the "
            f"{what}'s text")


def _retried(future: Future) -> bool:
    """Whether a cached compile is started again for the next identical request: one that
    raised or was cancelled is; one that timed out is not (it is refused at once)."""
    if not future.done():
        return False
    if future.cancelled():
        return True
    error = future.exception()
    return error is not None and not isinstance(error, CompileTimeoutError)


class StructuredOutputManager:
    """Owns the grammar backend (built lazily, on a compile thread, at the first constrained
    request), the compile pool and cache, and the per-step bitmask.

    Args:
        make_backend: builds the backend (loads the tokenizer; may take a second or two).
        vocab_size: the model's logits width (tokens).
        max_num_seqs: most rows a step can sample (bitmask buffer size).
        compile_timeout_s: seconds one compile may run (time queued for a thread not
            counted; the first compile's backend build counts).
        num_compile_threads: compiles running at once.
        max_compile_threads: compile threads alive at once, abandoned ones included (None:
            twice ``num_compile_threads``; see ``compile_pool``).
    """

    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], vocab_size: int,
                 max_num_seqs: int, compile_timeout_s: float = 30.0,
                 num_compile_threads: int = 2, max_compile_threads: int | None = None) -> None:
        self._make_backend = make_backend
        self.vocab_size = vocab_size
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.compile_timeout_s = compile_timeout_s
        self._num_compile_threads = num_compile_threads
        self._max_compile_threads = max_compile_threads
        self._pool: CompilePool | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiling: dict[str, tuple[str, Future]] = {}  # request id -> (kind, future)
        # request id -> (kind, state, allowed_token_ids or None): first steps to check once
        # compiled (a grammar matching no text, or none of the allowed ids)
        self._first_checks: dict[str, tuple[str, RequestStructuredOutput, list[int]]] = {}
        self._max_num_seqs = max_num_seqs
        self._bitmask: torch.Tensor | None = None

    def request_state(self, params: StructuredOutputsParams, request_id: str,
                      allowed_token_ids: list[int] | None = None,
                      reasoning: ReasoningGate | None = None) -> RequestStructuredOutput:
        """Start (or reuse) the compile of ``params`` for request ``request_id``; returns
        the request's state. ``take_failed`` names the request if its compile fails, or if
        the grammar's first token can be none of ``allowed_token_ids`` (the request's
        ``SamplingParams.allowed_token_ids``, None: any token). ``reasoning``: the request's
        reasoning gate (the grammar starts after the reasoning end marker), None: none."""
        key = params.key
        future = self._cache.get(key)
        if future is None or _retried(future):
            if self._pool is None:
                self._pool = CompilePool(self._num_compile_threads, self.compile_timeout_s,
                                         self._max_compile_threads)
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        state = RequestStructuredOutput(future, lambda compiled: self._backend.new_matcher(compiled),
                                        check_first_step=True, reasoning=reasoning)
        if not state.is_compiled:
            self._compiling[request_id] = (params.kind, future)
        self._first_checks[request_id] = (params.kind, state, allowed_token_ids or None)
        return state

    def forget(self, request_ids: list[str]) -> None:
        """Drop what ``request_state`` keeps of requests that ended before ``take_failed``
        named them (aborted while their grammar compiled; unknown ids are ignored). The
        compile itself runs on, its result cached for a later request of the grammar. Was:
        kept until the compile ended and a later step ran, so an idle engine held them."""
        for rid in request_ids:
            self._compiling.pop(rid, None)
            self._first_checks.pop(rid, None)

    def busy_message(self, params: StructuredOutputsParams) -> str | None:
        """Why ``params`` cannot be compiled now, or None when it can (or needs no compile:
        its grammar is cached, compiled or compiling): the compile pool is saturated
        (abandoned compiles alone fill ``max_compile_threads``), so a new compile would wait
        for one of them to end, which may take minutes. The server refuses such a request
        (429) rather than queue it."""
        future = self._cache.get(params.key)
        if self._pool is None or not self._pool.is_saturated or \
                (future is not None and not _retried(future)):
            return None
        return (f"the server is busy compiling structured-output grammars: "
                f"{self._pool.num_abandoned} compiles that passed the "
                f"{self.compile_timeout_s:g} s limit (--structured-output-compile-timeout) "
                f"still run, the most it allows (--structured-output-max-compile-threads "
                f"{self._pool.max_threads}); retry later")

    def _compile(self, params: StructuredOutputsParams) -> Any:
        try:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
            return self._backend.compile(params)
        except ValueError:
            # The backend's own refusal of the client's constraint (e.g. a count budget): the
            # request's 400 and the engine core's WARNING line carry its message; a traceback
            # at ERROR would report bad input as a server fault.
            raise
        except Exception:
            logger.exception("structured output: compiling %s failed", params.kind)
            raise

    def take_failed(self) -> list[tuple[str, str]]:
        """Abandon compiles past the time limit, then return ``(request id, error message)``
        for each request (given to ``request_state`` by id) whose compile failed since the
        last call: timed out (``structured_output_compile_timeout`` named) or raised (the
        error's message); or whose grammar compiled but allows none of its
        ``allowed_token_ids`` first (the others with such ids are ready now). Requests whose
        compile succeeded are forgotten here. Ids of
        requests finished meanwhile may be among them (the caller skips unknown ids)."""
        if self._pool is None or not (self._compiling or self._first_checks):
            return []
        if self._compiling and self._pool.expire():
            logger.warning("structured output: a grammar compile passed the %g s limit "
                           "(--structured-output-compile-timeout); %d abandoned compiles "
                           "still run", self.compile_timeout_s, self._pool.num_abandoned)
        failed = []
        for rid, (kind, future) in list(self._compiling.items()):
            if future.done():
                del self._compiling[rid]
                if future.cancelled() or future.exception() is not None:
                    failed.append((rid, self._failure_message(kind, future)))
        return failed + self._take_disjoint_first_steps()

    def _take_disjoint_first_steps(self) -> list[tuple[str, str]]:
        """``(request id, error message)`` of each compiled request whose grammar allows no
        first token at all (it matches no text, e.g. ``root ::= [^\\0-\\U0010ffff]``; a regex
        with such a class is refused before it compiles, ``regex_empty``), or none of
        its ``allowed_token_ids``: its first step's logits would all be masked, and it would
        end with no token and finish ``length``. Checked once per request, when its grammar
        is ready (one bitmask row: its matcher at the start)."""
        failed = []
        for rid, (kind, state, allowed) in list(self._first_checks.items()):
            if not state.is_compiled:
                if rid not in self._compiling:  # its compile failed: reported as such
                    del self._first_checks[rid]
                continue
            del self._first_checks[rid]
            row = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
            state.matcher.fill_bitmask(row, 0)
            message = _first_step_problem(row[0], allowed, _KIND_NAMES.get(kind, kind))
            if message is None:
                state.first_step_unchecked = False
            else:
                failed.append((rid, message))
        return failed

    def _failure_message(self, kind: str, future: Future) -> str:
        error = None if future.cancelled() else future.exception()
        if isinstance(error, CompileTimeoutError):
            what = _KIND_NAMES.get(kind, kind)
            return (f"the {what} did not compile within "
                    f"{self.compile_timeout_s:g} s (the server's "
                    "--structured-output-compile-timeout); simplify it (bounded repetitions "
                    "such as {2,40} of a rule are costly to compile for a large vocabulary)")
        if isinstance(error, ValueError):  # the backend's own check, with its message
            return str(error)
        return f"structured_outputs could not be compiled: {error or 'cancelled'}"

    def grammar_bitmask(self, request_ids: list[str], requests: dict[str, Request],
                        spec_tokens: dict[str, list[int]] | None = None
                        ) -> GrammarBitmask | None:
        """One bitmask row per constrained request that samples this step (``request_ids``,
        the step's ``structured_output_request_ids``); None if none does. Requests that
        finished meanwhile are skipped. A request verifying draft tokens (``spec_tokens``:
        n-gram drafts already cut to what its grammar accepts, or a draft model's proposal,
        never ``-1`` placeholders) gets one more row after each of them; the rows after a
        draft the grammar rejects (or after its stop token) allow nothing.

        A request without a matcher (never scheduled: its compile failed) would get a row
        allowing nothing, so it could never run unconstrained.
        """
        if self._pool is None or not request_ids:  # no constrained request this step
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
            try:
                free = state.reasoning.ended_after(tokens) if state.reasoning else 0
                self._fill_rows(None if state.error else state.matcher, tokens, row, free)
            except Exception as e:  # noqa: BLE001 - this request's matcher: its failure alone
                state.fail("filling its grammar's token mask", e)  # ended after the step
                self._bitmask[row:row + len(tokens) + 1].zero_()
            row_ids.extend([rid] * (len(tokens) + 1))
            row += len(tokens) + 1
        return GrammarBitmask(row_ids, self._bitmask[:num_rows])

    def draft_rows(self, requests: dict[str, Request], drafts: dict[str, list[int]]
                   ) -> GrammarBitmask | None:
        """A draft model's next draft's grammar rows (``sched_output.DraftGrammar``): per
        request of ``drafts``, the row after its tokens and its drafts so far (nothing after a
        draft its grammar rejects); a copy, not the step's buffer. None without such a
        request."""
        full = self.grammar_bitmask(list(drafts), requests, drafts)
        if full is None:
            return None
        ids = full.request_ids
        last = [i for i, rid in enumerate(ids) if i + 1 == len(ids) or ids[i + 1] != rid]
        return GrammarBitmask([ids[i] for i in last], full.bitmask[last])

    def _fill_rows(self, matcher: StructuredOutputGrammar | None, drafts: list[int],
                   row: int, free: int | None = 0) -> None:
        """Rows ``row .. row + len(drafts)``: what may follow each prefix of ``drafts``
        (nothing for a grammar that failed to compile or a draft it rejects). The first
        ``free`` prefixes are reasoning (``ReasoningGate.ended_after``; None: all): their rows
        allow every token, and the grammar reads the drafts after them."""
        free = len(drafts) + 1 if free is None else free
        self._bitmask[row:row + min(free, len(drafts) + 1)].fill_(-1)
        accepted = free
        for i in range(free, len(drafts) + 1):
            if matcher is None or accepted < i:
                self._bitmask[row + i].zero_()
                continue
            matcher.fill_bitmask(self._bitmask, row + i)
            if i < len(drafts) and matcher.accept_tokens([drafts[i]]):
                accepted += 1
        if matcher is not None and accepted > free:
            matcher.rollback(accepted - free)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds for a running compile to finish or pass its
        time limit (no-op when none runs)."""
        pending = [f for _, f in self._compiling.values() if not f.done()]
        if not pending:
            return
        deadline = self._pool.next_deadline()
        if deadline is not None:
            timeout_s = max(0.0, min(timeout_s, deadline - time.monotonic()))
        wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
