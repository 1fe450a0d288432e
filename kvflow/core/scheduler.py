"""The scheduler: continuous batching by one rule.

    There is no prefill phase and no decode phase. Each request has ``num_computed_tokens``
    (tokens whose K/V are cached) and ``num_tokens`` (prompt + generated). Every step hands out
    at most ``max_num_batched_tokens`` tokens and lets each request catch its computed count up
    toward its total. A long prompt is therefore split over steps (chunked prefill), a prefix-cache
    hit simply starts the count higher, and a decode is a catch-up of one token. A request that
    has caught up gets one sampled token at the end of the step.

Running requests are served first, in policy order; when the KV pool runs dry the request with
the largest policy key (the newest under FCFS) is preempted: its blocks are freed, its
``num_computed_tokens`` drops to 0 and it re-enters the waiting queue with all its tokens, so it
is recomputed later (often from prefix-cache hits) without losing or duplicating a token.

Several steps may be in flight at once (pipeline parallelism: each stage works on another
micro-batch). ``schedule`` advances ``num_computed_tokens`` as soon as it hands tokens out, so
a request whose scheduled tokens have not come back simply has nothing left to compute (a
decode waits for its sampled token) and is skipped, while a long prompt's next chunk can go
into the next micro-batch. A request in flight is never chosen for preemption (its blocks are
being written).

Speculative decoding (``speculator``) adds draft tokens to a decoding request's step: they are
just more tokens to compute, so the rule above is unchanged (the step catches
``num_computed_tokens`` up toward ``num_tokens`` plus the drafts, within the same budget). After
the step the rejected drafts are taken back: ``num_computed_tokens`` drops by their count (their
slots are written again later) and the blocks that held only rejected drafts are freed; the
runners learn the tables' new length in the next step's ``truncated_block_tables``. Drafts
never preempt: a request whose drafts find no free blocks decodes without them this step.

``long_prefill_token_threshold`` (vLLM's): while more than one request is unfinished, no
request computes more than that many tokens in one step (``chunk_cap``), so a long prompt's
chunks leave room in the budget for the others; a lone request takes the whole budget.

Service levels (``core/slo_planner.py``): with TTFT/TPOT targets, a ``StepBudget`` caps the
tokens of prefill chunks (never decodes) so the step is predicted to end before the earliest
running request's next-token deadline, gates admissions so a decode-only step stays under the
TPOT target, and requests that already missed their TTFT are admitted after those that can
still meet it. Without targets the fixed ``max_num_batched_tokens`` budget is the only limit.

The paths live beside this module, one job each: ``sched_running`` (catch the running requests
up, preempting when the pool runs dry), ``sched_admission`` (admit waiting requests) and
``sched_update`` (after the step: tokens, rejected drafts, stops), ``sched_arrivals`` (what
arrivals are told: admission control, the TTFT forecast, the idle batch window); this class
owns the state
and the requests' lifecycle (add, preempt, finish, free).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvflow.config import SchedulerConfig
from kvflow.core.encoder_cache_manager import EncoderCacheManager
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_swap import SwapManager
from kvflow.core.sched_admission import admit_waiting
from kvflow.core.sched_arrivals import admission_verdict, batch_wait_s, ttft_outlook
from kvflow.core.sched_policy import make_policy, make_waiting_queue
from kvflow.core.sched_running import schedule_running
from kvflow.core.sched_update import (
    discard_failed_steps,
    finished_request_stats,
    update_from_output,
)
from kvflow.core.slo_planner import NotedStep, SLOPlanner
from kvflow.distributed.kv_transfer import KVConnectorScheduler
from kvflow.engine_outputs import EngineCoreOutput, FinishedRequestStats, PromptTokenStats
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import SchedulerOutput
from kvflow.spec_decode.speculator import Speculator

_MAX_PENDING_STATS = 4096  # steps (finished requests) kept for the next take_* call


class Scheduler:
    """Decides, each step, which tokens of which requests to compute.

    Args:
        config: token budget, sequence cap and policy.
        kv_cache_manager: the KV block allocator.
        max_model_len: context limit (tokens); a request reaching it finishes with "length".
        send_token_ids: also send every step's computed tokens to the runners (for runners that
            do not sample, e.g. pipeline-parallel ranks before the last).
        clock: seconds on the clock of ``Request.arrival_time`` (``time.monotonic``; tests
            pass a fake clock).
        max_loras: most distinct LoRA adapters among the running requests (each needs a
            device slot in every step); None: no LoRA.

    With ``config.async_scheduling`` the next step is scheduled before the previous one's
    tokens come back: a request whose step samples counts its token as a placeholder
    (``num_output_placeholders``) that the next step computes (the runner reads it on the
    device), and a request whose pending tokens are sure to finish it (max_tokens,
    max_model_len) is not scheduled again. A stop token can only be seen when it arrives: the
    step computed meanwhile is dropped, so outputs and stops are exactly those of lock-step
    scheduling.
        speculator: proposes draft tokens each step (speculative decoding), or None.
        whole_prompts: never split a prompt over steps (encoder-only models: their attention
            is bidirectional, so a prompt is computed in one step or not at all; no
            ``long_prefill_token_threshold`` cap then).

    Raises:
        ValueError: for a ``long_prefill_token_threshold`` above ``max_model_len`` (vLLM's
            check).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, send_token_ids: bool = False,
                 speculator: Speculator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_loras: int | None = None, whole_prompts: bool = False) -> None:
        if config.long_prefill_token_threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold="
                             f"{config.long_prefill_token_threshold} cannot be greater than "
                             f"max_model_len ({max_model_len})")
        self.config = config
        self.max_loras = max_loras
        self.whole_prompts = whole_prompts
        self.send_token_ids = send_token_ids
        self.async_scheduling = bool(config.async_scheduling)
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = make_policy(config.policy)
        self.waiting = make_waiting_queue(self.policy, kv_cache_manager.peek_computed_tokens)
        self.clock = clock
        self.planner = SLOPlanner(config)
        self.swap: SwapManager | None = None  # the engine core sets it for swap preemption
        # KV transfer (--kv-transfer-config; the engine core sets it): admission asks it for
        # prompt blocks beyond the prefix-cache hit, each step tells it what to load and save
        self.connector: KVConnectorScheduler | None = None
        self.running: list[Request] = []
        self._running_sorted = True  # in policy order (appends by admission unsort it)
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # vLLM's tokens per step (``vllm:iteration_tokens_total``) of the steps since
        # ``take_iteration_tokens``: generated tokens, plus the computed prompt tokens
        # (not prefix-cache hits) of each request whose prefill completed there (in that step,
        # whatever earlier chunks computed). Bounded: an engine nobody reads keeps the last.
        self.iteration_tokens: deque[int] = deque(maxlen=_MAX_PENDING_STATS)
        # the phases of the requests that finished since ``take_finished_stats`` (bounded too)
        self.finished_stats: deque[FinishedRequestStats] = deque(maxlen=_MAX_PENDING_STATS)
        # where the prompt tokens came from (cumulative, /metrics' prompt_tokens_by_source), and
        # the ids of the waiting requests admission passed over for a transient constraint
        # and has not admitted since (vLLM's "deferred" waiting reason)
        self.prompt_token_stats = PromptTokenStats()
        self.deferred: set[str] = set()
        # Several steps in flight (pipeline parallelism; the engine core sets this): request
        # id -> its scheduled steps not yet returned.
        self.track_in_flight = False
        self.in_flight: dict[str, int] = {}
        # With steps in flight (async scheduling, pipelining): request id -> the count of
        # steps scheduled when a request of that id was freed. Outputs of those steps for that
        # id are the freed request's, and are dropped, even where a new request took the id.
        self.num_steps = 0
        self.freed_at: dict[str, int] = {}
        # Vision-language models (the engine core sets it): the encoder budget per step and
        # the encoder cache; requests with images pass through it (core/encoder_cache_manager)
        self.encoder: EncoderCacheManager | None = None
        self.speculator = speculator
        self._truncated: dict[str, int] = {}  # block-table lengths cut since the last step
        # when the first of the waiting requests reached an idle engine (--idle-batch-window-ms)
        self._idle_arrival: float | None = None

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request as waiting.

        Raises:
            ValueError: if its id is already in use, or it has ``max_model_len`` tokens or more
                (no room to generate; an embedding request may have ``max_model_len``).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_model_len or (
                request.num_tokens == self.max_model_len and request.pooling_params is None):
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens; "
                             f"max_model_len is {self.max_model_len}")
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        if not self.running and not self.waiting:
            self._idle_arrival = self.clock()
        self.requests[request.request_id] = request
        request.times.queued = self.clock()
        self.planner.add(request)
        self.waiting.open(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Stop requests (abort or stop string): free their blocks now. Unknown ids are ignored.
        One a stop string ended (``FINISHED_STOPPED``) after its first token finished: its
        phases go to ``finished_stats`` (an aborted one's do not, as in vLLM)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            if status is RequestStatus.FINISHED_STOPPED and request.times.first_token is not None:
                self.finished_stats.append(finished_request_stats(request, self.clock()))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def chunk_cap(self) -> int:
        """The most tokens one request computes in this step: ``long_prefill_token_threshold``
        while more than one request is unfinished (running or waiting), else 0 (no cap: a
        lone request starves no one, as in vLLM)."""
        threshold = self.config.long_prefill_token_threshold
        return threshold if threshold and len(self.requests) > 1 and \
            not self.whole_prompts else 0

    def batch_wait_s(self) -> float:
        """Seconds the next step should still wait for more arrivals (0.0: step now; only
        an idle engine's first step waits, ``idle_batch_window_ms``: see
        ``sched_arrivals.batch_wait_s``)."""
        return batch_wait_s(self)

    # ---- one step ----------------------------------------------------------------------------
    def finished_unsent(self) -> frozenset[str]:
        """The ids of requests finished since the last schedule (the runner has not been
        told yet: the next SchedulerOutput's ``finished_ids``)."""
        return frozenset(self._finished_ids)

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones if no preemption.

        Returns the step as changes since the previous one (see ``kvflow/sched_output.py``);
        each scheduled request's ``num_computed_tokens`` is advanced past the step.

        Args:
            max_num_reqs: schedule at most this many requests (a pipeline's micro-batch);
                None: as many as the token budget and ``max_num_seqs`` allow.
        """
        budget = self.config.max_num_batched_tokens
        cap = max_num_reqs if max_num_reqs is not None else self.config.max_num_seqs
        self.num_steps += 1
        out = SchedulerOutput(finished_ids=self._finished_ids, step_index=self.num_steps)
        self._finished_ids = set()
        if self.encoder is not None:
            self.encoder.begin_step(out)
        if self._truncated:
            out.truncated_block_tables, self._truncated = self._truncated, {}
        if not self._running_sorted:  # policy keys never change: sort after admissions only
            self.running.sort(key=self.policy.key)
            self._running_sorted = True
        if self.swap is not None:
            self.swap.release_read_blocks()
        now = self.clock()
        step_budget = self.planner.step_budget(self.running, now)
        drafts = self._propose_drafts(budget) if self.speculator is not None else None
        budget = schedule_running(self, budget, cap, out, drafts, step_budget)
        if not out.preempted_ids:
            budget, drained = admit_waiting(self, budget, cap, out, step_budget, now,
                                             skip_late=bool(self.planner.slos))
            if drained and budget > 0 and self.planner.slos:  # then those past their TTFT
                admit_waiting(self, budget, cap, out, step_budget, now)
        self.waiting.charge(out.num_scheduled_tokens, self.requests,
                            out.scheduled_spec_decode_tokens)
        self.planner.note_step(out, self.requests)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(
                [self.requests[rid] for rid in out.num_scheduled_tokens],
                lambda rid: self.kv.get_block_ids(rid)[0])
        return out

    def _propose_drafts(self, budget: int) -> dict[str, list[int]]:
        """This step's draft tokens by request id (speculative decoding)."""
        base = sum(len(r.all_token_ids) - r.num_computed_tokens for r in self.running)
        return self.speculator.propose(self.running, min(base, budget))

    def admission_verdict(self, request: Request) -> float | None:
        """Admission control: None to queue ``request``, else the seconds after which to
        retry, because its predicted time to first token exceeds its TTFT target (see
        ``sched_arrivals.admission_verdict``)."""
        return admission_verdict(self, request)

    def ttft_outlook(self, request: Request) -> float | None:
        """Predicted seconds from ``request``'s arrival to its first token if it were queued
        now (see ``SLOPlanner.ttft_outlook``); None when no prediction can be made."""
        return ttft_outlook(self, request)

    def record_step_time(self, seconds: float) -> None:
        """The step last returned by ``schedule`` took ``seconds`` (schedule to the next
        schedule): feeds the step-time model."""
        self.planner.record_step_time(seconds)

    def take_noted_step(self) -> NotedStep | None:
        """The step ``schedule`` just returned, for a caller that times it itself (several
        in flight: pipeline parallelism); see ``SLOPlanner.take_noted_step``."""
        return self.planner.take_noted_step()

    def record_noted_step_time(self, step: NotedStep | None, seconds: float) -> None:
        """Step ``step`` (from :meth:`take_noted_step`) took ``seconds``: feeds the step-time
        model."""
        self.planner.record_noted_step_time(step, seconds)

    def _note_sampling(self, request: Request, out: SchedulerOutput) -> None:
        """The step samples ``request``: its token is pending until the step comes back
        (async scheduling), and a constrained request is due a grammar bitmask row."""
        if self.async_scheduling:
            request.num_output_placeholders += 1
        if request.structured_output is not None:
            out.structured_output_request_ids.append(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Back to the waiting queue, every token kept; its KV freed for recomputation, or
        copied to host memory (``--preemption-mode swap``, when that costs less)."""
        if self.swap is not None and request.mm_features is None and \
                self.swap.should_swap(request):
            out.blocks_to_swap_out += self.swap.swap_out(request)  # computed count kept
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        if request.mm_features is not None:
            self.encoder.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    # ---- after the step ----------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append each sampled token, finish requests that stop, and report new tokens (in
        the step's scheduling order, which is the policy's).

        Tokens of requests that finished meanwhile are dropped. Several tokens per request
        (speculative decoding) are taken in order until one finishes the request. The prompt
        logprobs a step computed are kept on the request and reported with its first token.
        """
        return update_from_output(self, sched_out, runner_output)

    def take_finished_stats(self) -> list[FinishedRequestStats]:
        """The phases of the requests that finished (stop, length, pooled) since the last
        call, oldest first; forgets them."""
        out = list(self.finished_stats)
        self.finished_stats.clear()
        return out

    def take_iteration_tokens(self) -> list[int]:
        """The tokens of each step since the last call (see ``iteration_tokens``), oldest
        first; forgets them."""
        out = list(self.iteration_tokens)
        self.iteration_tokens.clear()
        return out

    def fail_steps(self, outs: list[SchedulerOutput]) -> None:
        """Steps ``outs`` will never complete (the model raised, or was interrupted): abort
        their requests, freeing their blocks, and keep the K/V they did not write out of the
        prefix cache (see ``sched_update.discard_failed_steps``)."""
        discard_failed_steps(self, outs)

    def _free(self, request: Request) -> None:
        if self.async_scheduling or self.track_in_flight:  # its steps may be in flight
            self.freed_at[request.request_id] = self.num_steps
        self.in_flight.pop(request.request_id, None)
        self._truncated.pop(request.request_id, None)
        self.planner.remove(request.request_id)
        if self.swap is not None:
            self.swap.drop(request.request_id)
        self.kv.free(request)
        if request.mm_features is not None:
            self.encoder.release(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        self.requests.pop(request.request_id, None)
        self.deferred.discard(request.request_id)
        self.waiting.close(request)
        self._finished_ids.add(request.request_id)
