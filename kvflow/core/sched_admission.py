"""The scheduler's admission path: admit waiting requests in policy order while the token
budget, ``max_num_seqs``, the LoRA slots and the KV pool allow (prefix-cache hits, and the
blocks a KV connector loads after them, start a request's computed count higher; a
swapped-out request comes back from host memory).

Functions of the ``Scheduler`` they are handed (``kvflow/core/scheduler.py`` states the
scheduling rule and owns the state they read and change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.core.slo_planner import StepBudget
from kvflow.request import Request, RequestStatus
from kvflow.sched_output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from kvflow.core.scheduler import Scheduler


def admit_waiting(sched: Scheduler, budget: int, cap: int, out: SchedulerOutput,
                  step_budget: StepBudget | None = None, now: float = 0.0,
                  skip_late: bool = False) -> tuple[int, bool]:
    """Admit waiting requests in policy order while the budgets, ``max_num_seqs`` and the
    KV pool allow. A request that does not fit blocks the queue, unless the queue reserves
    it and passes over it (the fair policy's backfilling: ``WaitingQueue.reserve``).
    ``skip_late``: pass over requests that already missed their TTFT target (a second call
    admits them). Returns what is left of ``budget`` and whether every waiting request was
    admitted or passed over for a transient constraint (nothing blocked the queue)."""
    waiting, running = sched.waiting, sched.running
    # grammars compiling, late, or adapters without a free slot: skipped, not blocking
    not_ready: list[Request] = []
    blocked = False  # a request was passed over because it did not fit
    # adapter ids of the running requests (admissions add theirs); None: no LoRA limit
    running_loras = None if sched.max_loras is None else \
        {r.lora_int_id for r in running} - {0}
    while waiting and budget > 0 and len(running) < sched.config.max_num_seqs \
            and len(out.num_scheduled_tokens) < cap:
        request = waiting.peek()
        if _deferred(sched, request, running_loras):
            sched.deferred.add(request.request_id)  # until admitted (vLLM's rule)
            not_ready.append(waiting.pass_over())
            continue
        if skip_late and sched.planner.is_late(request, now):
            not_ready.append(waiting.pass_over())
            continue
        if step_budget is not None and \
                not step_budget.may_admit(request, sched.planner.tpot_of(request)):
            break
        free = sched.kv.num_free_blocks
        num_new = _allocate_admitted(sched, request, budget, step_budget, out,
                                     waiting.backfill_limit(request))
        if num_new <= 0:
            if not waiting.reserve(request, free):
                break
            blocked = True
            not_ready.append(waiting.pass_over())
            continue
        waiting.admitted(request, free - sched.kv.num_free_blocks)
        _start_running(sched, request, num_new, out)
        if running_loras is not None and request.lora_int_id:
            running_loras.add(request.lora_int_id)
        budget -= num_new
    drained = not waiting and not blocked
    for request in not_ready:
        waiting.add(request)
    return budget, drained


def _deferred(sched: Scheduler, request: Request, running_loras: set[int] | None) -> bool:
    """Whether admission passes over ``request`` this step for a transient constraint (it
    stays queued without blocking the queue): every adapter slot is taken by other adapters,
    its grammar is compiling, or its token is still out."""
    if request.lora_request is not None and running_loras is not None and \
            request.lora_int_id not in running_loras and \
            len(running_loras) >= sched.max_loras:
        return True  # every adapter slot is taken
    return not request.is_schedulable or bool(request.num_output_placeholders)


def _allocate_admitted(sched: Scheduler, request: Request, budget: int,
                       step_budget: StepBudget | None, out: SchedulerOutput,
                       max_blocks: int | None = None) -> int:
    """The first step of the waiting queue's head: its prefix-cache hits, its tokens within
    the budgets (a whole prompt for ``whole_prompts``) and their slots, taking at most
    ``max_blocks`` free KV blocks (None: any); it leaves the queue. Returns its tokens (0:
    it does not fit this step, nothing allocated, still queued)."""
    if sched.swap is not None and sched.swap.holds(request):  # back from host memory
        num_new = _swap_in(sched, request, budget, step_budget, out, max_blocks)
        if num_new > 0:
            sched.waiting.pop()
        return num_new
    hits, num_hit_tokens = sched.kv.get_computed_blocks(request)
    # a KV connector's blocks after the local hits: allocated now, loaded before the forward
    num_external = 0 if sched.connector is None else \
        sched.connector.get_num_new_matched_tokens(request, num_hit_tokens)
    num_computed = num_hit_tokens + num_external
    num_new, encodes = _first_chunk(sched, request, num_computed, budget, step_budget)
    if sched.whole_prompts and num_new < request.num_tokens - num_computed:
        return 0  # a whole prompt next step, when the budget allows
    if num_new <= 0:
        return 0
    need = sched.kv.num_blocks_needed(request, num_external + num_new, hits)
    if need > sched.kv.num_free_blocks or (max_blocks is not None and need > max_blocks):
        return 0
    sched.waiting.pop()
    sched.kv.allocate_slots(request, num_external + num_new, hits)
    if num_external:
        sched.connector.update_state_after_alloc(
            request, sched.kv.get_block_ids(request.request_id)[0], num_hit_tokens,
            num_external)
    if request.mm_features is not None:
        sched.encoder.commit(request, num_computed, num_new, encodes, out)
    request.num_computed_tokens = num_computed
    if request.num_cached_tokens < 0:  # its first admission: counted once
        _count_cached(sched, request, num_hit_tokens, num_external)
    if request.times.scheduled is None:
        request.times.scheduled = sched.clock()
    return num_new


def _first_chunk(sched: Scheduler, request: Request, num_computed: int, budget: int,
                 step_budget: StepBudget | None) -> tuple[int, list[int] | None]:
    """(tokens, encoder plan) of an admitted request's first step after its
    ``num_computed`` cached tokens: within ``budget`` (and the chunk cap), a prefill chunk
    within ``step_budget``, and cut where the encoder's budget ends for a request with
    images (its plan then; None without images). Reserves nothing."""
    num_new = min(request.num_tokens - num_computed, _request_budget(sched, budget))
    if num_new > 1 and step_budget is not None:
        num_new = step_budget.take_prefill(num_computed, num_new)
    encodes = None
    if request.mm_features is not None:  # images: the encoder may cut the chunk
        num_new, encodes = sched.encoder.plan(request, num_computed, num_new)
    return num_new, encodes


def _count_cached(sched: Scheduler, request: Request, num_hit_tokens: int,
                  num_external: int) -> None:
    """Record a request's cached prompt tokens at its first admission: local prefix-cache
    hits and a KV connector's loaded tokens both count as cached (as vLLM's
    ``num_cached_tokens``); the prefix-cache hit rate counts the local hits, and with a
    connector vLLM's external_prefix_cache_queries / hits count the rest."""
    request.num_cached_tokens = num_hit_tokens + num_external
    request.num_external_cached_tokens = num_external
    sched.kv.count_prefix_query(request, num_hit_tokens)
    if sched.connector is not None:  # vLLM's external_prefix_cache_queries / hits
        sched.prompt_token_stats.external_queries += request.num_tokens - num_hit_tokens
        sched.prompt_token_stats.external_hits += num_external


def _request_budget(sched: Scheduler, budget: int) -> int:
    """What one admitted request may compute this step: what is left of ``budget``, within
    ``Scheduler.chunk_cap`` (``long_prefill_token_threshold``)."""
    chunk_cap = sched.chunk_cap()
    return min(budget, chunk_cap) if chunk_cap else budget


def _start_running(sched: Scheduler, request: Request, num_new: int,
                   out: SchedulerOutput) -> None:
    """An admitted request: sent to the runners, running, its step recorded."""
    _send_admitted(sched, request, num_new, out)
    sched.deferred.discard(request.request_id)
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    sched._running_sorted = False
    _record_scheduled(sched, request, num_new, out)


def _swap_in(sched: Scheduler, request: Request, budget: int, step_budget: StepBudget | None,
             out: SchedulerOutput, max_blocks: int | None = None) -> int:
    """Readmit a swapped-out request: its blocks back from host memory (its computed
    count kept) plus the step's tokens, taking at most ``max_blocks`` free blocks (None:
    any). Returns the step's tokens (0: it does not fit, nothing allocated)."""
    start = request.num_computed_tokens
    num_new = min(request.num_tokens - start, _request_budget(sched, budget))
    if num_new > 1 and step_budget is not None:
        num_new = step_budget.take_prefill(start, num_new)
    if num_new <= 0:
        return 0
    need = sched.swap.blocks_needed(request, num_new)
    if need > sched.kv.num_free_blocks or (max_blocks is not None and need > max_blocks):
        return 0
    out.blocks_to_swap_in += sched.swap.swap_in(request)
    sched.kv.allocate_slots(request, num_new)
    return num_new


def _send_admitted(sched: Scheduler, request: Request, num_new: int,
                   out: SchedulerOutput) -> None:
    """A first admission is sent whole; a readmission after preemption as a resumed cached
    request with its whole block tables and generated tokens (runners dropped both)."""
    block_ids = sched.kv.get_block_ids(request.request_id)
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
        pooling_params=request.pooling_params, prompt_embeds=request.prompt_embeds))


def _record_scheduled(sched: Scheduler, request: Request, num_new: int,
                      out: SchedulerOutput) -> None:
    """Count the request's tokens into the step and advance its computed count."""
    out.num_scheduled_tokens[request.request_id] = num_new
    out.total_num_scheduled_tokens += num_new
    request.num_computed_tokens += num_new
    if request.num_computed_tokens == request.num_tokens:  # the step samples
        sched._note_sampling(request, out)
    if sched.track_in_flight:
        sched.in_flight[request.request_id] = sched.in_flight.get(request.request_id, 0) + 1
