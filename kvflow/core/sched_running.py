"""The scheduler's running-request path: each step, catch the running requests' computed
counts up toward their tokens (drafts included), in policy order, within the token budget,
preempting the running tail when the KV pool runs dry.

Functions of the ``Scheduler`` they are handed (``kvflow/core/scheduler.py`` states the
scheduling rule and owns the state they read and change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.core.kv_cache_blocks import KVCacheBlocks
from kvflow.core.slo_planner import StepBudget
from kvflow.request import Request
from kvflow.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from kvflow.core.scheduler import Scheduler


def schedule_running(sched: Scheduler, budget: int, cap: int, out: SchedulerOutput,
                     drafts: dict[str, list[int]] | None = None,
                     step_budget: StepBudget | None = None) -> int:
    """Catch the running requests up, in policy order, within ``budget`` tokens and
    ``cap`` requests, their ``drafts`` included (prefill chunks also within
    ``step_budget``, and each request within ``Scheduler.chunk_cap``); returns what is left
    of the budget. This loop runs for every running request on every step, so it keeps what
    it reads in locals, fills ``out.scheduled_cached_reqs``' columns directly and calls a
    helper only for what a plain decode does not have (:func:`_slots_wanted`,
    :func:`_make_room`, :func:`_note_step`)."""
    running, cached, empty = sched.running, out.scheduled_cached_reqs, sched.kv.empty_blocks
    chunk_cap = sched.chunk_cap()
    try_allocate, num_scheduled = sched.kv.try_allocate_slots, out.num_scheduled_tokens
    add_id, add_computed = cached.req_ids.append, cached.num_computed_tokens.append
    send_token_ids = sched.send_token_ids
    every_step_noted = sched.async_scheduling or sched.track_in_flight  # see _note_step
    i = total = 0
    while i < len(running) and budget > 0 and len(num_scheduled) < cap:
        request = running[i]
        rid, computed = request.request_id, request.num_computed_tokens
        num_tokens = len(request.all_token_ids) + request.num_output_placeholders
        extra = drafts.get(rid) if drafts else None  # speculative decoding
        if num_tokens - computed == 1 and not extra and request.mm_features is None and (
                num_tokens < request.max_num_tokens or not request.num_output_placeholders):
            # a plain decode step: its next token (with async scheduling that token may be a
            # placeholder still on the device; one whose pending tokens finish the request
            # is not scheduled: _tokens_wanted), its slot usually in a block it holds
            # already (KVCacheManager's promise)
            num_new, encodes = 1, None
            new_blocks = empty if computed < request.kv_steady_until else \
                try_allocate(request, 1)
        else:
            num_new, encodes, new_blocks = _slots_wanted(
                sched, request, num_tokens, extra,
                min(budget, chunk_cap) if chunk_cap else budget, step_budget)
        if new_blocks is None and num_new > 0:  # no room: drop the drafts, then preempt
            new_blocks, extra, num_new = _make_room(sched, request, num_new,
                                                    num_tokens - computed, extra, out)
        if new_blocks is None:
            if i < len(running) and running[i] is request:
                i += 1  # nothing to do, or to preempt: it waits for the next step
            continue  # else it was preempted itself
        add_id(rid)
        add_computed(computed)
        if new_blocks is not empty:
            cached.new_block_ids[rid] = new_blocks.get_block_ids()
        if send_token_ids:
            cached.new_token_ids[rid] = step_token_ids(request, num_new)
        num_scheduled[rid] = num_new
        request.num_computed_tokens = computed + num_new
        if every_step_noted or extra or request.mm_features is not None or \
                request.structured_output is not None:
            _note_step(sched, request, out, computed, num_new, num_tokens, extra, encodes)
        total += num_new
        budget -= num_new
        i += 1
    out.total_num_scheduled_tokens += total
    return budget


def _slots_wanted(sched: Scheduler, request: Request, num_tokens: int,
                  extra: list[int] | None, budget: int, step_budget: StepBudget | None
                  ) -> tuple[int, object, KVCacheBlocks | None]:
    """A running request's step other than a plain decode (a prefill chunk, drafts,
    images, a token still out): the tokens it computes (:func:`_tokens_wanted`), the
    encoder's plan for its images, and their new blocks (None: the pool has no room, or
    there is nothing to compute)."""
    num_new, encodes = _tokens_wanted(sched, request, num_tokens, extra, budget, step_budget)
    new_blocks = sched.kv.try_allocate_slots(request, num_new) if num_new > 0 else None
    return num_new, encodes, new_blocks


def _note_step(sched: Scheduler, request: Request, out: SchedulerOutput, computed: int,
               num_new: int, num_tokens: int, extra: list[int] | None,
               encodes: object) -> None:
    """What a scheduled step of ``request`` (``num_new`` tokens from ``computed``; its
    ``num_tokens`` with placeholders) carries beyond its tokens and blocks: its images'
    encodes, the drafts the budget left it, that it samples (async scheduling's
    placeholder, a constrained request's bitmask row; drafts go past its tokens) and its
    count of steps in flight (pipeline parallelism)."""
    rid, end = request.request_id, computed + num_new
    if request.mm_features is not None:
        sched.encoder.commit(request, computed, num_new, encodes, out)
    if extra and end > num_tokens:  # the budget may have cut the drafts short
        out.scheduled_spec_decode_tokens[rid] = extra[:end - num_tokens]
    if end >= num_tokens and (sched.async_scheduling or request.structured_output is not None):
        sched._note_sampling(request, out)
    if sched.track_in_flight:
        sched.in_flight[rid] = sched.in_flight.get(rid, 0) + 1


def _tokens_wanted(sched: Scheduler, request: Request, num_tokens: int,
                   extra: list[int] | None, budget: int, step_budget: StepBudget | None
                   ) -> tuple[int, object]:
    """How many tokens a running request computes this step, at most ``budget``
    (``num_tokens``: its tokens, async scheduling's placeholders included; ``extra``: its
    drafts), and the encoder's plan for its images. 0 when its pending tokens finish it, its
    sampling step is in flight or the encoder cut it to nothing."""
    computed = request.num_computed_tokens
    if request.num_output_placeholders and num_tokens >= request.max_num_tokens:
        return 0, None  # async scheduling: the tokens still out finish it
    num_new = min(num_tokens + (len(extra) if extra else 0) - computed, budget)
    if num_new > 1 and step_budget is not None and not extra:  # a prefill chunk
        num_new = step_budget.take_prefill(computed, num_new)  # SLO-sized
    if num_new <= 0:  # its sampling step is in flight (pipeline parallelism)
        return 0, None
    if request.mm_features is not None:  # images: the encoder may cut the chunk
        return sched.encoder.plan(request, computed, num_new)
    return num_new, None


def _make_room(sched: Scheduler, request: Request, num_new: int, num_base: int,
               extra: list[int] | None, out: SchedulerOutput
               ) -> tuple[KVCacheBlocks | None, list[int] | None, int]:
    """Slots for ``num_new`` tokens of ``request`` (``num_base`` of them not drafts) when
    the pool had none: without room for its drafts it decodes plainly (drafts never
    preempt); without room for its own tokens the running tail is preempted. Returns the
    new blocks (None: no room), the drafts kept and the tokens to compute."""
    new_blocks = None
    if extra and num_new > num_base:
        # drafts never preempt: without room for them the request decodes plainly
        extra, num_new = None, num_base
        new_blocks = sched.kv.try_allocate_slots(request, num_new)
    if new_blocks is None:
        new_blocks = preempt_until_fits(sched, request, num_new, out)
    return new_blocks, extra, num_new


def step_token_ids(request: Request, num_new: int) -> list[int]:
    """The tokens a step computes (sent to runners with ``send_token_ids``)."""
    start = request.num_computed_tokens
    return request.all_token_ids[start:start + num_new]


def preempt_until_fits(sched: Scheduler, request: Request, num_new: int,
                       out: SchedulerOutput) -> KVCacheBlocks | None:
    """Preempt the running tail (requests not in flight, which includes those this step
    scheduled) until ``request`` fits, then allocate. Returns the new blocks, or None if
    ``request`` itself had to be preempted or nothing is left to preempt."""
    new_blocks = None
    while new_blocks is None:
        victim = _victim(sched)
        if victim is None:
            return None
        sched._preempt(victim, out)
        out.preempted_ids.append(victim.request_id)
        if victim is request:
            return None
        new_blocks = sched.kv.try_allocate_slots(request, num_new)
    return new_blocks


def _victim(sched: Scheduler) -> Request | None:
    """The running request to preempt: the last in policy order, skipping requests in
    flight when several steps are (pipeline parallelism); taken out of ``running``."""
    running = sched.running
    if not sched.track_in_flight:
        return running.pop() if running else None
    for k in range(len(running) - 1, -1, -1):
        if running[k].request_id not in sched.in_flight:
            return running.pop(k)
    return None
