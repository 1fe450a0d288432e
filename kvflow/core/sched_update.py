"""The scheduler's path after a step: append each request's sampled tokens, take back the
rejected drafts of speculative decoding, finish the requests that stop, report new tokens.

Functions of the ``Scheduler`` they are handed (``kvflow/core/scheduler.py`` states the
scheduling rule and owns the state they read and change); the stop rule on one request is in
``sched_stops``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.core.sched_failures import end_failed_requests
from kvflow.core.sched_stops import append_tokens, check_stop
from kvflow.engine_outputs import EngineCoreOutput, FinishedRequestStats, PromptTokenStats
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from kvflow.core.scheduler import Scheduler


def update_from_output(sched: Scheduler, sched_out: SchedulerOutput,
                       runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """``Scheduler.update_from_output``: each scheduled request's outputs, in the step's
    scheduling (policy) order. This loop runs for every scheduled request on every step, so
    it keeps what it reads in locals and calls one helper per request: on a step without
    drafts or SLO targets, a decode's one token that cannot finish its request is appended by
    :func:`_appended_plainly` and its output built here; everything else goes through
    :func:`_sampled_output`."""
    outputs, requests, pooled = [], sched.requests, runner_output.pooler_output
    stale = _take_freed(sched, sched_out)
    _keep_prompt_logprobs(requests, runner_output, stale)
    sampled = _sampled_tokens(sched, runner_output)
    if runner_output.failed:  # requests that failed alone: ended, their tokens dropped
        outputs += end_failed_requests(sched, sched_out, runner_output.failed, stale)
        for rid in runner_output.failed:
            sampled.pop(rid, None)
    track, now = sched.track_in_flight, sched.clock()
    # no drafts to roll back, no SLO planner to tell: a plain decode may skip _sampled_output
    plain = not sched_out.scheduled_spec_decode_tokens and not sched.planner.slos
    logprobs = runner_output.logprobs
    num_iteration_tokens = 0  # vLLM's count: see Scheduler.iteration_tokens
    for rid in sched_out.num_scheduled_tokens:  # report in scheduling (policy) order
        if rid in stale:  # its request was freed meanwhile (the id may be another's now)
            continue
        if track:
            _returned(sched, rid)
        request = requests.get(rid)
        if request is None:
            continue
        token_ids = sampled.get(rid)
        if token_ids is not None and request.num_output_placeholders:
            request.num_output_placeholders -= 1  # async scheduling: it has arrived
        if request.status.is_finished:
            continue
        if pooled and rid in pooled:
            outputs.append(_pooled_output(sched, request, pooled[rid], now))
            num_iteration_tokens += _num_prompt_computed(request)
        elif token_ids is not None:
            if plain and not (logprobs and rid in logprobs) and \
                    _appended_plainly(request, token_ids, now):
                outputs.append(EngineCoreOutput(rid, token_ids, None, None,
                                                request.stop_reason, request.num_cached_tokens))
                num_iteration_tokens += 1
            else:
                num_iteration_tokens += _sampled_output(sched, sched_out, runner_output,
                                                        request, token_ids, now, outputs, stale)
    sched.iteration_tokens.append(num_iteration_tokens)
    return outputs


def _appended_plainly(request: Request, token_ids: list[int], now: float) -> bool:
    """A decode's one sampled token (``token_ids``) appended, its time noted, when that is
    all :func:`_sampled_output` would do: no grammar, not its first token, no prompt logprobs
    to hand over, no repetition detection, and not a token that finishes it (the length
    limit; EOS or a stop id once ``min_tokens`` are out: ``check_stop``'s rule). Returns
    whether it did (False: nothing changed)."""
    if len(token_ids) != 1 or request.structured_output is not None or \
            request.times.first_token is None or request.prompt_logprobs is not None or \
            request.sampling_params.repetition_detection is not None:
        return False
    token, all_ids = token_ids[0], request.all_token_ids
    num_tokens = len(all_ids) + 1
    if num_tokens >= request.max_num_tokens or num_tokens > request.min_stop_len and (
            token == request.stop_eos_id or token in request.sampling_params.stop_token_ids):
        return False
    all_ids.append(token)
    request.times.last_token = now
    return True


def _sampled_tokens(sched: Scheduler, runner_output: ModelRunnerOutput) -> dict[str, list[int]]:
    """Request id -> the tokens the step sampled for it (accepted drafts, then the bonus or
    next token), without those of the requests whose K/V failed to load (sent back to be
    recomputed: :func:`recompute_failed_loads`)."""
    sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
    if runner_output.kv_load_failures:  # their tokens came from K/V that never arrived
        for rid in recompute_failed_loads(sched, runner_output.kv_load_failures):
            sampled.pop(rid, None)
    return sampled


def _sampled_output(sched: Scheduler, sched_out: SchedulerOutput,
                    runner_output: ModelRunnerOutput, request: Request, token_ids: list[int],
                    now: float, outputs: list[EngineCoreOutput], stale: set[str]) -> int:
    """Fold one running request's sampled ``token_ids`` in (drafts rolled back, tokens
    appended up to a stop), append its output to ``outputs`` and free it if it finished (or
    end it alone when its grammar matcher raised: :func:`end_failed_requests`, ``stale``
    being the step's freed ids). Returns its iteration tokens (those appended, plus its
    computed prompt tokens when they are its first)."""
    rid, spec_tokens = request.request_id, sched_out.scheduled_spec_decode_tokens
    num_drafts = len(spec_tokens[rid]) if spec_tokens and rid in spec_tokens else 0
    if num_drafts:
        _roll_back_rejected(sched, request, num_drafts, len(token_ids) - 1)
    if len(token_ids) == 1 and request.structured_output is None:  # the common case
        request.all_token_ids.append(token_ids[0])
        check_stop(request, token_ids[0])
        new_token_ids = token_ids
    else:
        new_token_ids = append_tokens(request, token_ids)
        so = request.structured_output
        if so is not None and so.error is not None:  # its matcher raised: it alone ends
            outputs += end_failed_requests(sched, sched_out, {rid: so.error}, stale)
            return 0
    num_tokens = _note_tokens(sched, request, len(new_token_ids), now)
    logprobs = runner_output.logprobs.get(rid) if runner_output.logprobs and new_token_ids \
        else None
    status = request.status
    outputs.append(EngineCoreOutput(
        rid, new_token_ids, logprobs[:len(new_token_ids)] if logprobs else None,
        status.finish_reason, request.stop_reason, request.num_cached_tokens,
        None if request.prompt_logprobs is None else request.take_prompt_logprobs(),
        num_drafts, len(token_ids) - 1 if num_drafts else 0))
    if status.is_finished:
        _dequeue(sched, request)
        sched._free(request)
        sched.finished_stats.append(finished_request_stats(request, now))
    elif num_drafts:
        _free_rejected_blocks(sched, request)
    return num_tokens


def _note_tokens(sched: Scheduler, request: Request, num_new: int, now: float) -> int:
    """Record ``num_new`` tokens appended to ``request`` at ``now``: the SLO planner's
    count, its first / latest token times, its prompt tokens by source when they are its
    first. Returns its iteration tokens (``num_new``, plus its computed prompt tokens when
    these are its first)."""
    if sched.planner.slos:
        sched.planner.on_tokens(request.request_id, num_new, now)
    if not num_new:
        return 0
    times = request.times
    if times.first_token is None:  # its first tokens: prefill completed
        times.first_token = now
        count_prompt_sources(sched.prompt_token_stats, request)
        num_new += _num_prompt_computed(request)
    times.last_token = now
    return num_new


def _pooled_output(sched: Scheduler, request: Request, vector: list[float],
                   now: float) -> EngineCoreOutput:
    """An embedding request whose prompt is computed: done at ``now``, its blocks freed at
    once, its phases and prompt tokens by source recorded."""
    request.times.first_token = request.times.last_token = now
    output = _finish_pooled(sched, request, vector)
    sched.finished_stats.append(finished_request_stats(request, now))
    count_prompt_sources(sched.prompt_token_stats, request)
    return output


def finished_request_stats(request: Request, now: float) -> FinishedRequestStats:
    """vLLM's phase times of a request finishing ``now`` (a phase it never reached: 0)."""
    t = request.times
    queued = t.queued if t.queued is not None else now
    scheduled = t.scheduled if t.scheduled is not None else queued
    first = t.first_token if t.first_token is not None else now
    last = t.last_token if t.last_token is not None else first
    return FinishedRequestStats(scheduled - queued, first - scheduled, last - first,
                                last - scheduled, request.num_preemptions,
                                _num_prompt_computed(request))


def count_prompt_sources(stats: PromptTokenStats, request: Request) -> None:
    """A request's prefill completed: add its prompt tokens by source (vLLM's
    ``prompt_tokens_by_source``) as its first admission found them: computed, local
    prefix-cache hits, tokens the KV connector loaded."""
    cached = max(request.num_cached_tokens, 0)
    stats.local_compute += request.num_prompt_tokens - cached
    stats.local_cache_hit += cached - request.num_external_cached_tokens
    stats.external_kv_transfer += request.num_external_cached_tokens


def _num_prompt_computed(request: Request) -> int:
    """The prompt tokens computed for a request whose prefill just completed: those the
    prefix cache did not hold at its first admission."""
    return request.num_prompt_tokens - max(request.num_cached_tokens, 0)


def _take_freed(sched: Scheduler, sched_out: SchedulerOutput) -> set[str]:
    """The ids of ``sched_out``'s requests that were freed after it was scheduled (aborted, or
    finished by an earlier step while it was in flight): its outputs for them are dropped,
    also where a new request has taken the id since (a step scheduled after the free came
    later). Steps come back in the order they were scheduled, so the frees no step still in
    flight can hold are forgotten here."""
    freed = sched.freed_at
    if not freed:
        return set()
    step = sched_out.step_index
    stale = {rid for rid in sched_out.num_scheduled_tokens if freed.get(rid, -1) >= step}
    sched.freed_at = {rid: at for rid, at in freed.items() if at > step}
    return stale


def recompute_failed_loads(sched: Scheduler, failures: dict[str, str]) -> set[str]:
    """``kv_load_failure_policy="recompute"``: the KV connector could not load the blocks
    ``failures`` names (request id -> the key of its first block not loaded), so the step
    read whatever those blocks held. The connector never offers those keys again; each such
    request, and each running one holding one of those blocks or a later block of theirs (a
    prefix-cache hit on them), goes back to the waiting queue as a recompute preemption does
    (its readmission loads what storage still has and computes the rest; its cached-token
    count is taken again), and the blocks from the first bad one on leave the prefix cache.
    Returns the requests sent back (their sampled tokens are dropped)."""
    kv, victims = sched.kv, {}
    for rid, key in failures.items():
        request = sched.requests.get(rid)
        if request is not None and request.status == RequestStatus.RUNNING:
            victims[rid] = sched.connector.load_failed(request, key)
    bad: set[int] = set()
    while True:  # until no other running request holds a bad block
        bad = {b for rid, i in victims.items() for b in kv.get_block_ids(rid)[0][i:] if b}
        more = {}
        for request in sched.running:
            if request.request_id not in victims:
                ids = kv.get_block_ids(request.request_id)[0]
                hit = next((i for i, b in enumerate(ids) if b in bad), None)
                if hit is not None:
                    more[request.request_id] = hit
        if not more:
            break
        victims.update(more)
        for rid in more:  # the runner did not save what they computed over the bad blocks
            sched.connector.saves_dropped(sched.requests[rid])
    for rid in victims:
        request = sched.requests[rid]
        sched.running.remove(request)
        kv.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1  # counted again at its readmission
        if request.mm_features is not None:
            sched.encoder.release(request)
        request.status = RequestStatus.PREEMPTED
        sched.waiting.add(request)
    kv.uncache_blocks(bad)
    return set(victims)


def discard_failed_steps(sched: Scheduler, outs: list[SchedulerOutput]) -> None:
    """``Scheduler.fail_steps``: abort the requests scheduled in steps that did not complete,
    then take the free blocks out of the prefix cache. The steps' blocks were indexed when
    allocated, but their K/V were never written (or only partly), and a later request with
    the same prefix would read them; once their requests are aborted (and any preempted by a
    later failed step already is) they are all free, while every block a running request
    holds was written by a step that completed. A request swapped out by such a step is
    recomputed instead (its blocks were never copied to the host). The images those steps
    were to encode leave the encoder-cache mirror (the runners may not hold them)."""
    scheduled: list[str] = []
    for out in outs:  # not a request freed meanwhile, whose id another may hold now
        stale = _take_freed(sched, out)
        scheduled += [rid for rid in out.num_scheduled_tokens if rid not in stale]
        for rid in out.preempted_ids:
            _forget_swap_out(sched, rid)
    lost = _scheduled_encodes(sched, outs)
    sched.finish_requests(scheduled, RequestStatus.FINISHED_ABORTED)
    sched.kv.reset_prefix_cache()
    if sched.encoder is not None:  # the runners may not hold what those steps encoded
        sched.encoder.forget(lost)


def _scheduled_encodes(sched: Scheduler, outs: list[SchedulerOutput]) -> set[str]:
    """Identifiers of the images the steps ``outs`` were to encode."""
    lost = set()
    for out in outs:
        for rid, indices in out.scheduled_encoder_inputs.items():
            request = sched.requests.get(rid)
            if request is not None and request.mm_features:
                lost.update(request.mm_features[i].identifier for i in indices)
    return lost


def _forget_swap_out(sched: Scheduler, request_id: str) -> None:
    """A swap-out whose copy never ran: the request is recomputed from its tokens."""
    request = sched.requests.get(request_id)
    if sched.swap is not None and request is not None and sched.swap.holds(request):
        sched.swap.drop(request_id)
        request.num_computed_tokens = 0


def _keep_prompt_logprobs(requests: dict[str, Request], runner_output: ModelRunnerOutput,
                          stale: set[str]) -> None:
    """Keep the prompt logprobs the step computed on their requests (reported with the
    first token); not those of the requests freed meanwhile (``stale``)."""
    for rid, chunk in runner_output.prompt_logprobs.items():
        request = requests.get(rid)
        if request is not None and rid not in stale:
            request.add_prompt_logprobs(chunk.start, chunk.entries)


def _roll_back_rejected(sched: Scheduler, request: Request, num_drafts: int,
                        num_accepted: int) -> None:
    """The step computed K/V for all ``num_drafts`` drafts; only the accepted ones stay
    computed (the slots of the rejected ones are written again by later steps)."""
    request.num_computed_tokens -= num_drafts - num_accepted
    sched.speculator.record(request, num_drafts, num_accepted)


def _free_rejected_blocks(sched: Scheduler, request: Request) -> None:
    """Free the blocks past the request's tokens (they held only rejected drafts) and
    tell the runners the tables' new length with the next step."""
    num_blocks = sched.kv.free_tail(request, request.num_tokens)
    if num_blocks is not None:
        sched._truncated[request.request_id] = num_blocks


def _finish_pooled(sched: Scheduler, request: Request, vector: list[float]) -> EngineCoreOutput:
    """An embedding request whose prompt is computed: done, its blocks freed at once."""
    request.status = RequestStatus.FINISHED_STOPPED
    _dequeue(sched, request)
    sched._free(request)
    return EngineCoreOutput(request.request_id, [], finish_reason="stop",
                            num_cached_tokens=request.num_cached_tokens,
                            pooling_output=vector)


def _dequeue(sched: Scheduler, request: Request) -> None:
    """Take a request out of the running list (or, preempted meanwhile, the waiting queue)."""
    if request in sched.running:
        sched.running.remove(request)
    else:
        sched.waiting.remove(request)


def _returned(sched: Scheduler, request_id: str) -> None:
    """One scheduled step of ``request_id`` came back."""
    left = sched.in_flight.pop(request_id, 0) - 1
    if left > 0:
        sched.in_flight[request_id] = left
