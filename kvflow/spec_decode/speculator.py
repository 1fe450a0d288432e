"""The engine core's side of speculative decoding: which requests verify how many drafts.

Each step, before the scheduler hands out its token budget, ``Speculator.propose`` gives every
running request that has caught up (only its last sampled token left to compute) a list of
draft tokens: the n-gram proposer's tokens, or ``-1`` placeholders that the runner's draft model
fills at the start of the step. The scheduler then treats them as more tokens to compute for
that request (the scheduling rule does not change: ``num_computed_tokens`` catches up toward
``num_tokens`` plus the drafts). After the step, ``record`` counts what the target accepted.

How many: up to ``num_speculative_tokens``, never past ``max_tokens``, ``max_model_len`` or
the draft model's own context (``draft_positions.py``);
with ``adaptive`` the lengths come from ``cost_model.choose_draft_lengths`` (each request's
running acceptance rate against the measured step costs), and a step whose base token count
has no recent measurement runs without drafts once to measure it.

Constrained requests (structured output, tool-call grammars) are speculated too, with every
verified position masked by the grammar, so the output distribution (and logprobs) are exactly
those of non-speculative constrained decoding. Their n-gram drafts are cut here at the first
token the grammar rejects (the matcher accepts them one by one and is rolled back). A draft
model proposes inside the runner, at the start of the step, where the grammar is not known: the
step loop then splits the step (``core/engine_steps.py``): the runner proposes (each draft within
the grammar's row after the drafts before it, which the core hands it or answers) and runs the
target's forward pass, the engine core reads the proposed drafts and fills the bitmask rows
after each of them (``StructuredOutputManager.grammar_bitmask``: rows after a draft the grammar
rejects allow nothing, and the rejection sampler rejects that draft, as the target's masked
``p`` gives it zero probability), then the runner samples. Only an executor that splits steps
(``Executor.splits_draft_steps``: the in-process one and mp, whose workers take the two halves
as two messages) can do that; under ray a draft model does not speculate constrained requests
(``constrained_draft_model`` False).
"""

from __future__ import annotations

import numpy as np

from kvflow.config import SpeculativeConfig
from kvflow.config.speculative import HEAD_METHODS
from kvflow.request import Request
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import SchedulerOutput
from kvflow.spec_decode.cost_model import (
    MIN_GAIN,
    StepTimes,
    acceptance_estimate,
    choose_draft_lengths,
)
from kvflow.spec_decode.ngram import propose_ngram


class Speculator:
    """Proposes each step's draft tokens and keeps the acceptance record.

    Args:
        config: the speculative-decoding config.
        max_model_len: the context limit (tokens); drafts never reach past it.
        draft_cost_ratio: a draft pass's cost over a target step's of as many tokens while
            no draft pass is measured (the cost model's fallback; default 1.0: as costly as
            the target). An engine times its draft at start-up instead
            (``observe_draft_passes``).
        constrained_draft_model: whether a draft model drafts for constrained requests (the
            step loop must then fill their bitmask rows after the runner proposed: an
            executor that splits steps); ignored for n-gram drafts, which always do.
        draft_positions: the positions the draft model's rotary table covers
            (``draft_positions.draft_positions``; None: no limit but ``max_model_len``):
            drafts never reach past it either, so a request longer than the draft's context
            decodes without drafts (its passes would index past the table).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft_cost_ratio: float = 1.0, constrained_draft_model: bool = False,
                 draft_positions: int | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # drafts stay below both contexts (the target's and the drafter's)
        self.draft_len_limit = max_model_len if draft_positions is None else \
            min(max_model_len, draft_positions)
        self.uses_draft_model = config.method in ("draft_model", *HEAD_METHODS)
        self.constrained_draft_model = constrained_draft_model
        self.draft_cost_ratio = draft_cost_ratio  # the fallback before any draft pass is timed
        self.min_gain = MIN_GAIN  # the predicted gain speculation must clear
        self.target_times = StepTimes()
        self.draft_times = StepTimes() if self.uses_draft_model else None
        self.draft_passes_at_start: list[tuple[int, float]] = []  # observe_draft_passes
        # engine-wide counters (vLLM's spec_decode_* metrics)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * config.num_speculative_tokens
        self._num_rejections = 0

    # ---- before a step -----------------------------------------------------------------------
    def propose(self, running: list[Request], num_base_tokens: int) -> dict[str, list[int]]:
        """Draft tokens for this step, by request id (requests without drafts are absent).

        Args:
            running: the running requests; those with exactly one token left to compute
                (decodes) are candidates.
            num_base_tokens: tokens the step computes without drafts (for the cost model).
        """
        candidates, drafts = [], []
        for request in running:
            room = self._room(request)
            if room <= 0:
                continue
            tokens = self._candidate_drafts(request, room)
            if len(tokens):
                candidates.append(request)
                drafts.append(tokens)
        if not candidates:
            return {}
        lengths = self._lengths(candidates, drafts, num_base_tokens)
        return {r.request_id: d[:k].tolist() for r, d, k in zip(candidates, drafts, lengths)
                if k}

    def _room(self, request: Request) -> int:
        """Drafts the request can take: 0 unless it is a decode; capped by K, max_tokens
        (the bonus token counts), max_model_len and the draft model's positions."""
        num_tokens = len(request.all_token_ids)
        if num_tokens - request.num_computed_tokens != 1:
            return 0
        params = request.sampling_params
        left = params.max_tokens - (num_tokens - len(request.prompt_token_ids)) - 1 \
            if params.max_tokens is not None else self.config.num_speculative_tokens
        return min(self.config.num_speculative_tokens, left,
                   self.draft_len_limit - num_tokens - 1)

    def _candidate_drafts(self, request: Request, room: int) -> np.ndarray:
        """The proposer's tokens (int64 [<= room]) before the length choice."""
        if self.uses_draft_model:  # placeholders: the runner's draft model proposes them
            if request.structured_output is not None and not self.constrained_draft_model:
                return np.zeros(0, np.int64)
            return np.full(room, -1, np.int64)
        cfg = self.config
        tokens = propose_ngram(np.asarray(request.all_token_ids, np.int64), room,
                               cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if len(tokens) and request.structured_output is not None:
            tokens = tokens[:request.structured_output.num_valid_drafts(tokens.tolist())]
        return tokens

    def _lengths(self, candidates: list[Request], drafts: list[np.ndarray],
                 num_base_tokens: int) -> np.ndarray:
        available = np.array([len(d) for d in drafts], np.int64)
        if not self.config.adaptive:
            return available
        if not self.target_times.is_measured(num_base_tokens):
            return np.zeros(len(candidates), np.int64)  # measure this step size first
        prior = (self.num_accepted_tokens + 1) / (self.num_accepted_tokens +
                                                  self._num_rejections + 2)
        counts = [r.spec_counts for r in candidates]
        alpha = acceptance_estimate(np.array([c.num_accepted_tokens for c in counts], float),
                                    np.array([c.num_rejections for c in counts], float), prior)
        # an EAGLE / MTP head reads prompts as the target computes them and keeps no more
        # than a step's features (spec_decode/eagle.py): nothing to catch up
        catch_up = self._catch_up_tokens(candidates, alpha) \
            if self.config.method == "draft_model" else None
        return choose_draft_lengths(alpha, available, num_base_tokens, self.target_times,
                                    self.draft_times, seed_ratio=self.draft_cost_ratio,
                                    catch_up_tokens=catch_up, min_gain=self.min_gain)

    def _catch_up_tokens(self, candidates: list[Request], alpha: np.ndarray) -> np.ndarray:
        """Draft-model tokens each candidate's first draft would recompute beyond a steady
        pass (float64 [R]): its context past the draft K/V in place (``SpecDecodeCounts.
        draft_synced_tokens``, the computed tokens at its last verification; none after a
        preemption since), spread over
        the steps it has left at the expected tokens per step of full-length drafts."""
        k = self.config.num_speculative_tokens
        lag = np.array([len(r.all_token_ids) - 2 - (
            r.spec_counts.draft_synced_tokens
            if r.spec_counts.synced_preemptions == r.num_preemptions else 0)
            for r in candidates], np.float64)
        left = np.array([self._tokens_left(r) for r in candidates], np.float64)
        per_step = (1.0 - alpha ** (k + 1)) / np.maximum(1.0 - alpha, 1e-9)
        return np.maximum(lag, 0.0) / np.maximum(left / per_step, 1.0)

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request may still generate (max_tokens, else max_model_len)."""
        params, num_tokens = request.sampling_params, len(request.all_token_ids)
        if params.max_tokens is None:
            return self.max_model_len - num_tokens
        return params.max_tokens - (num_tokens - len(request.prompt_token_ids))

    # ---- after a step ------------------------------------------------------------------------
    def record(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification: ``num_accepted`` of the request's ``num_draft_tokens``."""
        request.spec_counts.record(num_draft_tokens, num_accepted)
        counts = request.spec_counts
        counts.draft_synced_tokens = request.num_computed_tokens
        counts.synced_preemptions = request.num_preemptions
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._num_rejections += num_accepted < num_draft_tokens
        for i in range(num_accepted):
            self.num_accepted_per_pos[i] += 1

    def observe_draft_passes(self, passes: list[tuple[int, float]]) -> None:
        """Seed the draft model's cost with passes timed before serving: ``(requests in the
        pass, seconds)`` pairs (``draft_timing.time_draft_passes``); ignored without a draft
        model. Later measured passes average into the same bins."""
        if self.draft_times is None:
            return
        self.draft_passes_at_start = list(passes)
        for rows, seconds in passes:
            self.draft_times.observe(int(rows), float(seconds))

    def observe_step(self, sched: SchedulerOutput, runner_output: ModelRunnerOutput,
                     seconds: float) -> None:
        """Feed one executed step's measured time to the cost model: the target's part by
        the step's token count, the draft model's per steady pass by the requests drafting
        (a pass that catches a request's draft K/V up over its whole context is left out)."""
        if sched.is_empty:
            return
        self.target_times.observe(sched.total_num_scheduled_tokens,
                                  max(seconds - runner_output.draft_time_s, 0.0))
        drafts = sched.scheduled_spec_decode_tokens
        if self.draft_times is not None and drafts and runner_output.draft_pass_s > 0:
            self.draft_times.observe(len(drafts), runner_output.draft_pass_s)
