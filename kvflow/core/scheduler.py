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

Service levels (``core/slo_planner.py``): with TTFT/TPOT targets, a ``StepBudget`` caps the
tokens of prefill chunks (never decodes) so the step is predicted to end before the earliest
running request's next-token deadline, gates admissions so a decode-only step stays under the
TPOT target, and requests that already missed their TTFT are admitted after those that can
still meet it. Without targets the fixed ``max_num_batched_tokens`` budget is the only limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvflow.config import SchedulerConfig
from kvflow.core.encoder_cache_manager import EncoderCacheManager
from kvflow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvflow.core.kv_swap import SwapManager
from kvflow.core.sched_policy import make_policy, make_waiting_queue
from kvflow.core.slo_planner import SLOPlanner, StepBudget
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import NewRequestData, SchedulerOutput
from kvflow.spec_decode.speculator import Speculator


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
            is bidirectional, so a prompt is computed in one step or not at all).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, send_token_ids: bool = False,
                 speculator: Speculator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_loras: int | None = None, whole_prompts: bool = False) -> None:
        self.config = config
        self.max_loras = max_loras
        self.whole_prompts = whole_prompts
        self.send_token_ids = send_token_ids
        self.async_scheduling = bool(config.async_scheduling)
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = make_policy(config.policy)
        self.waiting = make_waiting_queue(self.policy)
        self.clock = clock
        self.planner = SLOPlanner(config)
        self.swap: SwapManager | None = None  # the engine core sets it for swap preemption
        self.running: list[Request] = []
        self._running_sorted = True  # in policy order (appends by admission unsort it)
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # Several steps in flight (pipeline parallelism; the engine core sets this): request
        # id -> its scheduled steps not yet returned.
        self.track_in_flight = False
        self.in_flight: dict[str, int] = {}
        # Vision-language models (the engine core sets it): the encoder budget per step and
        # the encoder cache; requests with images pass through it (core/encoder_cache_manager)
        self.encoder: EncoderCacheManager | None = None
        self.speculator = speculator
        self._truncated: dict[str, int] = {}  # block-table lengths cut since the last step

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
        self.requests[request.request_id] = request
        self.planner.add(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Stop requests (abort or stop string): free their blocks now. Unknown ids are ignored."""
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----------------------------------------------------------------------------
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
        out = SchedulerOutput(finished_ids=self._finished_ids)
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
        budget = self._schedule_running(budget, cap, out, drafts, step_budget)
        if not out.preempted_ids:
            budget, drained = self._admit_waiting(budget, cap, out, step_budget, now,
                                                  skip_late=bool(self.planner.slos))
            if drained and budget > 0 and self.planner.slos:  # then those past their TTFT
                self._admit_waiting(budget, cap, out, step_budget, now)
        self.waiting.charge(out.num_scheduled_tokens, self.requests)
        self.planner.note_step(out, self.requests)
        return out

    def _propose_drafts(self, budget: int) -> dict[str, list[int]]:
        """This step's draft tokens by request id (speculative decoding)."""
        base = sum(len(r.all_token_ids) - r.num_computed_tokens for r in self.running)
        return self.speculator.propose(self.running, min(base, budget))

    def admission_verdict(self, request: Request) -> float | None:
        """Admission control: None to queue ``request``, else the seconds after which to
        retry, because its predicted time to first token exceeds its TTFT target. Accepts
        while the step-time model is still learning, when the request has no TTFT target,
        and on an idle engine (nothing running or waiting): there no request is delayed by
        it and none would be served sooner, and the forecast is then a pure extrapolation of
        one lone prefill, where the fitted model errs most (it refused lone requests a warm
        server answered well within target)."""
        if not self.running and not self.waiting:
            return None
        slo = self.planner.targets_of(request)
        outlook = None if slo.ttft_s is None else self.ttft_outlook(request)
        if outlook is None or outlook <= slo.ttft_s:
            return None
        # past the forecast's horizon: by one target from now the queue ahead has moved on
        late_by = slo.ttft_s if outlook == math.inf else outlook - slo.ttft_s
        return float(max(1, math.ceil(late_by)))

    def ttft_outlook(self, request: Request) -> float | None:
        """Predicted seconds from ``request``'s arrival to its first token if it were queued
        now (see ``SLOPlanner.ttft_outlook``); None when no prediction can be made."""
        key, peek = self.policy.key(request), self.kv.peek_computed_tokens
        ahead = [(r, r.num_tokens - peek(r)) for r in self.waiting
                 if self.policy.name == "fair" or self.policy.key(r) <= key]
        return self.planner.ttft_outlook(request, request.num_tokens - peek(request),
                                         self.running, ahead, self.clock())

    def record_step_time(self, seconds: float) -> None:
        """The step last returned by ``schedule`` took ``seconds`` (schedule to the next
        schedule): feeds the step-time model."""
        self.planner.record_step_time(seconds)

    def _schedule_running(self, budget: int, cap: int, out: SchedulerOutput,
                          drafts: dict[str, list[int]] | None = None,
                          step_budget: StepBudget | None = None) -> int:
        """Catch the running requests up, in policy order, within ``budget`` tokens and
        ``cap`` requests, their ``drafts`` included (prefill chunks also within
        ``step_budget``); returns what is left of the budget. This loop runs for every running
        request on every step, so it keeps what it reads in locals and fills
        ``out.scheduled_cached_reqs``' columns directly."""
        running, cached, empty = self.running, out.scheduled_cached_reqs, self.kv.empty_blocks
        try_allocate, num_scheduled = self.kv.try_allocate_slots, out.num_scheduled_tokens
        add_id, add_computed = cached.req_ids.append, cached.num_computed_tokens.append
        track, send_token_ids = self.track_in_flight, self.send_token_ids
        i = total = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < cap:
            request = running[i]
            rid, computed = request.request_id, request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            if request.num_output_placeholders:  # async scheduling: tokens still out
                num_tokens += request.num_output_placeholders
                if num_tokens >= request.max_num_tokens:  # they finish it: nothing to do
                    i += 1
                    continue
            extra = drafts.get(rid) if drafts else None  # speculative decoding
            num_new = min(num_tokens + (len(extra) if extra else 0) - computed, budget)
            if num_new > 1 and step_budget is not None and not extra:  # a prefill chunk
                num_new = step_budget.take_prefill(computed, num_new)  # SLO-sized
            if num_new <= 0:  # its sampling step is in flight (pipeline parallelism)
                i += 1
                continue
            if request.mm_features is not None:  # images: the encoder may cut the chunk
                num_new, encodes = self.encoder.plan(request, computed, num_new)
                if num_new <= 0:
                    i += 1
                    continue
            new_blocks = try_allocate(request, num_new)
            if new_blocks is None and extra and num_new > num_tokens - computed:
                # drafts never preempt: without room for them the request decodes plainly
                extra, num_new = None, num_tokens - computed
                new_blocks = try_allocate(request, num_new)
            if new_blocks is None:
                new_blocks = self._preempt_until_fits(request, num_new, out)
                if new_blocks is None:
                    if i < len(running) and running[i] is request:
                        i += 1  # nothing left to preempt: it waits for the next step
                    continue  # else it was preempted itself
            if request.mm_features is not None:
                self.encoder.commit(request, computed, num_new, encodes, out)
            add_id(rid)
            add_computed(computed)
            if new_blocks is not empty:
                cached.new_block_ids[rid] = new_blocks.get_block_ids()
            if send_token_ids:
                cached.new_token_ids[rid] = self._step_token_ids(request, num_new)
            num_scheduled[rid] = num_new
            total += num_new
            request.num_computed_tokens = computed + num_new
            if extra:  # the budget may have cut the drafts short
                num_drafts = computed + num_new - num_tokens
                if num_drafts > 0:
                    out.scheduled_spec_decode_tokens[rid] = extra[:num_drafts]
            if computed + num_new >= num_tokens:  # the step samples (drafts go past)
                self._note_sampling(request, out)
            if track:
                self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
            budget -= num_new
            i += 1
        out.total_num_scheduled_tokens += total
        return budget

    def _step_token_ids(self, request: Request, num_new: int) -> list[int]:
        """The tokens a step computes (sent to runners with ``send_token_ids``)."""
        start = request.num_computed_tokens
        return request.all_token_ids[start:start + num_new]

    def _record_scheduled(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """Count the request's tokens into the step and advance its computed count."""
        out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens:  # the step samples
            self._note_sampling(request, out)
        if self.track_in_flight:
            self.in_flight[request.request_id] = self.in_flight.get(request.request_id, 0) + 1

    def _note_sampling(self, request: Request, out: SchedulerOutput) -> None:
        """The step samples ``request``: its token is pending until the step comes back
        (async scheduling), and a constrained request is due a grammar bitmask row."""
        if self.async_scheduling:
            request.num_output_placeholders += 1
        if request.structured_output is not None:
            out.structured_output_request_ids.append(request.request_id)

    def _preempt_until_fits(self, request: Request, num_new: int,
                            out: SchedulerOutput) -> KVCacheBlocks | None:
        """Preempt the running tail (requests not in flight, which includes those this step
        scheduled) until ``request`` fits, then allocate. Returns the new blocks, or None if
        ``request`` itself had to be preempted or nothing is left to preempt."""
        new_blocks = None
        while new_blocks is None:
            victim = self._victim()
            if victim is None:
                return None
            self._preempt(victim, out)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return None
            new_blocks = self.kv.try_allocate_slots(request, num_new)
        return new_blocks

    def _victim(self) -> Request | None:
        """The running request to preempt: the last in policy order, skipping requests in
        flight when several steps are (pipeline parallelism); taken out of ``running``."""
        if not self.track_in_flight:
            return self.running.pop() if self.running else None
        for k in range(len(self.running) - 1, -1, -1):
            if self.running[k].request_id not in self.in_flight:
                return self.running.pop(k)
        return None

    def _admit_waiting(self, budget: int, cap: int, out: SchedulerOutput,
                       step_budget: StepBudget | None = None, now: float = 0.0,
                       skip_late: bool = False) -> tuple[int, bool]:
        """Admit waiting requests in policy order while the budgets, ``max_num_seqs`` and the
        KV pool allow. ``skip_late``: pass over requests that already missed their TTFT
        target (a second call admits them). Returns what is left of ``budget`` and whether
        every waiting request was admitted or passed over (nothing blocked the queue)."""
        # grammars compiling, late, or adapters without a free slot: skipped, not blocking
        not_ready: list[Request] = []
        running_loras = None  # adapter ids of the running requests, computed when needed
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(out.num_scheduled_tokens) < cap:
            request = self.waiting.peek()
            if request.lora_request is not None and self.max_loras is not None:
                if running_loras is None:
                    running_loras = {r.lora_int_id for r in self.running} - {0}
                if request.lora_int_id not in running_loras and \
                        len(running_loras) >= self.max_loras:
                    not_ready.append(self.waiting.pop())  # every adapter slot is taken
                    continue
            if not request.is_schedulable or request.num_output_placeholders or \
                    (skip_late and self.planner.is_late(request, now)):
                not_ready.append(self.waiting.pop())  # grammar compiling / token out / late
                continue
            if step_budget is not None and \
                    not step_budget.may_admit(request, self.planner.tpot_of(request)):
                break
            if self.swap is not None and self.swap.holds(request):  # back from host memory
                num_new = self._swap_in(request, budget, step_budget, out)
                if num_new <= 0:
                    break
                self.waiting.pop()
            else:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_hit_tokens, budget)
                if num_new > 1 and step_budget is not None:
                    num_new = step_budget.take_prefill(num_hit_tokens, num_new)
                if request.mm_features is not None:  # images: the encoder may cut the chunk
                    num_new, encodes = self.encoder.plan(request, num_hit_tokens, num_new)
                if self.whole_prompts and num_new < request.num_tokens - num_hit_tokens:
                    break  # a whole prompt next step, when the budget allows
                if num_new <= 0 or not self.kv.can_allocate(request, num_new, hits):
                    break
                self.waiting.pop()
                self.kv.allocate_slots(request, num_new, hits)
                if request.mm_features is not None:
                    self.encoder.commit(request, num_hit_tokens, num_new, encodes, out)
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
            self._send_admitted(request, num_new, out)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_sorted = False
            self._record_scheduled(request, num_new, out)
            if running_loras is not None and request.lora_int_id:
                running_loras.add(request.lora_int_id)
            budget -= num_new
        drained = not self.waiting
        for request in not_ready:
            self.waiting.add(request)
        return budget, drained

    def _swap_in(self, request: Request, budget: int, step_budget: StepBudget | None,
                 out: SchedulerOutput) -> int:
        """Readmit a swapped-out request: its blocks back from host memory (its computed
        count kept) plus the step's tokens. Returns the step's tokens (0: it does not fit,
        nothing allocated)."""
        start = request.num_computed_tokens
        num_new = min(request.num_tokens - start, budget)
        if num_new > 1 and step_budget is not None:
            num_new = step_budget.take_prefill(start, num_new)
        if num_new <= 0 or self.swap.blocks_needed(request, num_new) > self.kv.num_free_blocks:
            return 0
        out.blocks_to_swap_in += self.swap.swap_in(request)
        self.kv.allocate_slots(request, num_new)
        return num_new

    def _send_admitted(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """A first admission is sent whole; a readmission after preemption as a resumed cached
        request with its whole block tables and generated tokens (runners dropped both)."""
        block_ids = self.kv.get_block_ids(request.request_id)
        if request.status == RequestStatus.PREEMPTED:
            cached, rid = out.scheduled_cached_reqs, request.request_id
            cached.req_ids.append(rid)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.new_block_ids[rid] = block_ids
            cached.new_token_ids[rid] = request.output_token_ids
            cached.resumed_req_ids.add(rid)
            return
        out.scheduled_new_reqs.append(NewRequestData(
            req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, eos_token_id=request.eos_token_id,
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
            mm_features=request.mm_features, lora_request=request.lora_request,
            pooling_params=request.pooling_params))

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
        outputs, requests, all_logprobs = [], self.requests, runner_output.logprobs
        track, check_stop = self.track_in_flight, self._check_stop
        for rid, chunk in runner_output.prompt_logprobs.items():
            request = requests.get(rid)
            if request is not None:
                request.add_prompt_logprobs(chunk.start, chunk.entries)
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        spec_tokens = sched_out.scheduled_spec_decode_tokens
        slos, now = self.planner.slos, self.clock()
        pooled = runner_output.pooler_output
        for rid in sched_out.num_scheduled_tokens:  # report in scheduling (policy) order
            if track:
                self._returned(rid)
            token_ids = sampled.get(rid)
            request = requests.get(rid)
            if token_ids is not None and request is not None and \
                    request.num_output_placeholders:
                request.num_output_placeholders -= 1  # async scheduling: it has arrived
            if pooled and rid in pooled and request is not None and \
                    not request.status.is_finished:
                outputs.append(self._finish_pooled(request, pooled[rid]))
                continue
            if token_ids is None or request is None or request.status.is_finished:
                continue
            num_drafts = len(spec_tokens[rid]) if spec_tokens and rid in spec_tokens else 0
            if num_drafts:
                self._roll_back_rejected(request, num_drafts, len(token_ids) - 1)
            if len(token_ids) == 1 and request.structured_output is None:  # the common case
                request.all_token_ids.append(token_ids[0])
                check_stop(request, token_ids[0])
                new_token_ids = token_ids
            else:
                new_token_ids = self._append_tokens(request, token_ids)
            if slos:
                self.planner.on_tokens(rid, len(new_token_ids), now)
            logprobs = all_logprobs.get(rid) if all_logprobs and new_token_ids else None
            status = request.status
            outputs.append(EngineCoreOutput(
                rid, new_token_ids, logprobs[:len(new_token_ids)] if logprobs else None,
                status.finish_reason, request.stop_reason, request.num_cached_tokens,
                None if request.prompt_logprobs is None else request.take_prompt_logprobs(),
                num_drafts, len(token_ids) - 1 if num_drafts else 0))
            if status.is_finished:
                self._dequeue(request)
                self._free(request)
            elif num_drafts:
                self._free_rejected_blocks(request)
        return outputs

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step computed K/V for all ``num_drafts`` drafts; only the accepted ones stay
        computed (the slots of the rejected ones are written again by later steps)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.speculator.record(request, num_drafts, num_accepted)

    def _free_rejected_blocks(self, request: Request) -> None:
        """Free the blocks past the request's tokens (they held only rejected drafts) and
        tell the runners the tables' new length with the next step."""
        num_blocks = self.kv.free_tail(request, request.num_tokens)
        if num_blocks is not None:
            self._truncated[request.request_id] = num_blocks

    def _finish_pooled(self, request: Request, vector: list[float]) -> EngineCoreOutput:
        """An embedding request whose prompt is computed: done, its blocks freed at once."""
        request.status = RequestStatus.FINISHED_STOPPED
        self._dequeue(request)
        self._free(request)
        return EngineCoreOutput(request.request_id, [], finish_reason="stop",
                                num_cached_tokens=request.num_cached_tokens,
                                pooling_output=vector)

    def _dequeue(self, request: Request) -> None:
        """Take a request out of the running list (or, preempted meanwhile, the waiting queue)."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append tokens until one finishes the request; returns those appended."""
        appended = []
        for token_id in token_ids:
            if request.structured_output is not None and \
                    not request.structured_output.accept_token(token_id):
                # the grammar admits no further token: the output is cut here (the matcher
                # advances before the token is appended, so both always agree)
                request.status = RequestStatus.FINISHED_LENGTH
                break
            request.all_token_ids.append(token_id)
            appended.append(token_id)
            if self._check_stop(request, token_id):
                break
        return appended

    @staticmethod
    def _check_stop(request: Request, token: int) -> bool:
        """Finish the request if ``token`` (just appended) stops it; returns whether it did.
        EOS and stop ids count once ``min_tokens`` are out (they were masked until then); the
        length limit is ``max_tokens`` or ``max_model_len``, whichever comes first."""
        num_tokens = len(request.all_token_ids)
        if num_tokens > request.min_stop_len:
            if token == request.stop_eos_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in request.sampling_params.stop_token_ids:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
        if num_tokens >= request.max_num_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _returned(self, request_id: str) -> None:
        """One scheduled step of ``request_id`` came back."""
        left = self.in_flight.pop(request_id, 0) - 1
        if left > 0:
            self.in_flight[request_id] = left

    def _free(self, request: Request) -> None:
        self.in_flight.pop(request.request_id, None)
        self._truncated.pop(request.request_id, None)
        self.planner.remove(request.request_id)
        if self.swap is not None:
            self.swap.drop(request.request_id)
        self.kv.free(request)
        if request.mm_features is not None:
            self.encoder.release(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
