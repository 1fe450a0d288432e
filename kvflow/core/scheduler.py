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
"""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.sched_policy import WaitingQueue, make_policy
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import PromptLogprobsChunk, SampledToken
from kvflow.sched_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides, each step, which tokens of which requests to compute.

    Args:
        config: token budget, sequence cap and policy.
        kv_cache_manager: the KV block allocator.
        max_model_len: context limit (tokens); a request reaching it finishes with "length".
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = make_policy(config.policy)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.in_flight: dict[str, int] = {}  # request id -> scheduled steps not yet returned

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request as waiting.

        Raises:
            ValueError: if its id is already in use, or it has ``max_model_len`` tokens or more
                (no room to generate).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens; "
                             f"max_model_len is {self.max_model_len}")
        self.requests[request.request_id] = request
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

        Args:
            max_num_reqs: schedule at most this many requests (a pipeline's micro-batch);
                None: as many as the token budget and ``max_num_seqs`` allow.
        """
        budget = self.config.max_num_batched_tokens
        cap = max_num_reqs if max_num_reqs is not None else self.config.max_num_seqs
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = set()
        self.running.sort(key=self.policy.key)
        scheduled: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, out):
                scheduled.append((request, num_new))
                budget -= num_new
            if i < len(self.running) and self.running[i] is request:
                i += 1  # else it was preempted and the next request moved up
        if not out.preempted_ids:
            budget = self._admit_waiting(budget, scheduled, cap)
        out.scheduled = [self._scheduled_request(r, n) for r, n in scheduled]
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            self.in_flight[request.request_id] = self.in_flight.get(request.request_id, 0) + 1
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate room for ``request``, preempting the running tail (requests not in
        flight) until it fits. Returns False if it does not fit (``request`` itself may have
        been preempted)."""
        while not self.kv.can_allocate(request, num_new):
            victim = next((r for r in reversed(self.running)
                           if r.request_id not in self.in_flight), None)
            if victim is None:  # everything else is in flight: try again next step
                return False
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        self.kv.allocate_slots(request, num_new)
        return True

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]],
                       cap: int) -> int:
        not_ready: list[Request] = []  # grammars still compiling: skipped, not blocking
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(scheduled) < cap:
            request = self.waiting.peek()
            if not request.is_schedulable:
                not_ready.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.can_allocate(request, num_new, hits):
                break
            self.waiting.pop()
            self.kv.allocate_slots(request, num_new, hits)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        for request in not_ready:
            self.waiting.add(request)
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def _scheduled_request(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            do_sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            output_token_ids=request.output_token_ids,
            eos_token_id=request.eos_token_id,
            prompt_token_ids=request.prompt_token_ids,
        )

    # ---- after the step ----------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, SampledToken],
                           prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
                           ) -> list[EngineCoreOutput]:
        """Append each sampled token, finish requests that stop, and report new tokens; the
        prompt logprobs a step computed are kept on the request and reported with its first
        token."""
        for rid, chunk in (prompt_logprobs or {}).items():
            request = self.requests.get(rid)
            if request is not None:
                request.add_prompt_logprobs(chunk.start, chunk.entries)
        outputs = []
        for sreq in sched_out.scheduled:
            self._returned(sreq.request_id)
            token = sampled.get(sreq.request_id)
            request = self.requests.get(sreq.request_id)
            if token is None or request is None or request.is_finished:
                continue
            new_token_ids = [token.token_id]
            if self._accept_structured(request, token.token_id):
                request.append_output_token(token.token_id)
                self._check_stop(request)
            else:  # the grammar admits no further token: the output is cut here
                new_token_ids = []
                request.status = RequestStatus.FINISHED_LENGTH
            outputs.append(EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=new_token_ids,
                new_logprobs=[token.logprobs] if token.logprobs is not None and new_token_ids
                else None,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                prompt_logprobs=request.take_prompt_logprobs()))
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
        return outputs

    @staticmethod
    def _accept_structured(request: Request, token_id: int) -> bool:
        """Advance a constrained request's matcher (before the token is appended, so matcher
        and tokens never disagree); False if the grammar rejects the token."""
        return request.structured_output is None or \
            request.structured_output.accept_token(token_id)

    def _check_stop(self, request: Request) -> None:
        params, token = request.sampling_params, request.all_token_ids[-1]
        if request.num_output_tokens > params.min_tokens:  # stop ids were masked until now
            if not params.ignore_eos and token == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH

    def _returned(self, request_id: str) -> None:
        """One scheduled step of ``request_id`` came back."""
        left = self.in_flight.pop(request_id, 0) - 1
        if left > 0:
            self.in_flight[request_id] = left

    def _free(self, request: Request) -> None:
        self.in_flight.pop(request.request_id, None)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
