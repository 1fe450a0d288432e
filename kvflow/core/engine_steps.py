"""The engine core's step variants, each schedule -> execute -> update: lock-step, async
scheduling (step N+1's forward launched before step N's tokens are folded in) and the
pipeline's queue of micro-batches in flight. ``EngineCore.step`` picks one.

Functions of the ``EngineCore`` they are handed (``kvflow/core/engine_core.py`` owns the
scheduler, the executor and the state they read and change).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, NamedTuple

from kvflow.core.slo_planner import NotedStep
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.executor import StepFuture
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import GrammarBitmask, SchedulerOutput

if TYPE_CHECKING:
    from kvflow.core.engine_core import EngineCore


class InFlightStep(NamedTuple):
    """A micro-batch sent and not yet folded back in (pipeline parallelism).

    Attributes:
        future: its runner output, once the last stage has sampled.
        sched: what was scheduled.
        started: ``time.perf_counter()`` (seconds) when its scheduling began.
        noted: its features and predicted time for the step-time model (None: empty step).
    """

    future: StepFuture
    sched: SchedulerOutput
    started: float
    noted: NotedStep | None


def step_sync(core: EngineCore) -> list[EngineCoreOutput]:
    """Lock-step: schedule a batch, run the model on it, and fold the sampled tokens back in.
    A failed (or interrupted) step aborts what it scheduled, keeps the K/V it did not write
    out of the prefix cache, and raises."""
    scheduler_output = core.scheduler.schedule()
    if scheduler_output.is_empty:  # only grammars compiling: wait a little, do not spin
        core.structured_output.wait_for_compiles(timeout_s=0.05)
    started = time.perf_counter()
    try:
        runner_output = execute_with_grammar(core, scheduler_output)
    except BaseException:  # KeyboardInterrupt too: LLM.generate's caller may go on
        # The step's K/V were not written: abort what it scheduled (freeing their blocks)
        # so the engine stays consistent for the other requests, then report the error.
        core.scheduler.fail_steps([scheduler_output])
        raise
    if core.speculator is not None:  # the measured step cost (adaptive draft lengths)
        core.speculator.observe_step(scheduler_output, runner_output,
                                     time.perf_counter() - started)
    return core.scheduler.update_from_output(scheduler_output, runner_output)


def execute_with_grammar(core: EngineCore, sched: SchedulerOutput) -> ModelRunnerOutput:
    """Run one step with its grammar bitmask. The bitmask rows of a constrained request that
    verifies drafts follow its drafts; a draft model's drafts (``-1`` placeholders in
    ``sched``) are known only once the runner proposed them, so such a step is split: the
    runner proposes, each draft within the grammar's row after the drafts before it (draft 1
    within the current row, handed over with the step; the later rows asked of the core,
    ``StructuredOutputManager.draft_rows``), and launches the target's forward pass; the
    verification rows are filled after the proposed drafts (while the forward pass runs on a
    GPU), then the runner samples (``Executor.proposed_drafts``; the speculator drafts so only
    where ``Executor.splits_draft_steps``: the uni and mp executors)."""
    drafts, constrained = sched.scheduled_spec_decode_tokens, sched.structured_output_request_ids
    so, requests, executor = core.structured_output, core.scheduler.requests, core.executor
    if not any(-1 in drafts.get(rid, ()) for rid in constrained):
        return executor.execute_model(sched, so.grammar_bitmask(constrained, requests, drafts))
    # draft 1 is chosen within the grammar's current row (a copy: the buffer is refilled)
    first = so.grammar_bitmask(constrained, requests)
    try:
        executor.launch_forward(sched, first and GrammarBitmask(first.request_ids,
                                                                first.bitmask.clone()),
                                functools.partial(so.draft_rows, requests))
        proposed = {**drafts, **executor.proposed_drafts()}
        executor.launch_sampling(so.grammar_bitmask(constrained, requests, proposed))
        return executor.collect_output()
    except BaseException:
        executor.discard_output()
        raise


def step_async(core: EngineCore) -> list[EngineCoreOutput]:
    """Async scheduling: schedule step N+1 and launch its forward pass while step N's
    sampled tokens are still on the device (the runner feeds them to N+1 there), then wait
    for N's tokens and fold them in, then launch N+1's sampling (whose grammar bitmask and
    penalties need N's tokens). Returns step N's outputs: the same as lock-step ones, one
    step later.
    """
    sched, prev = core.scheduler.schedule(), core._in_flight
    core._in_flight = None
    try:
        core.executor.launch_forward(sched)
        outputs = [] if prev is None else \
            core.scheduler.update_from_output(prev, core.executor.collect_output())
        core.executor.launch_sampling(core.structured_output.grammar_bitmask(
            sched.structured_output_request_ids, core.scheduler.requests))
    except BaseException:
        # Neither step's results will come back: abort both steps' requests (freeing
        # their blocks), then report the error.
        core.executor.discard_output()
        core.scheduler.fail_steps([sched] if prev is None else [prev, sched])
        raise
    if not sched.is_empty:
        core._in_flight = sched
    elif prev is None:  # only grammars compiling: wait a little, do not spin
        core.structured_output.wait_for_compiles(timeout_s=0.05)
    return outputs


def step_with_batch_queue(core: EngineCore) -> list[EngineCoreOutput]:
    """Pipeline parallelism: keep up to ``max_concurrent_batches`` micro-batches in flight.

    While there is room, schedule a micro-batch of at most ``1 / max_concurrent_batches``
    of the unfinished requests (so at steady state every stage has one) from the requests
    that are not in flight, send it and return; otherwise wait for the oldest one and fold
    its sampled tokens in.
    """
    depth = core.executor.max_concurrent_batches
    if len(core.batch_queue) < depth:
        started = time.perf_counter()
        sched = core.scheduler.schedule(max_num_reqs=micro_batch_size(core, depth))
        noted = core.scheduler.take_noted_step()  # timed when its tokens are folded in
        if not sched.is_empty or sched.changes_runners:  # a swap-out's copy too
            bitmask = core.structured_output.grammar_bitmask(
                sched.structured_output_request_ids, core.scheduler.requests)
            core.batch_queue.append(InFlightStep(
                core.executor.execute_model_async(sched, bitmask), sched, started, noted))
            if len(core.batch_queue) < depth and not sched.is_empty:
                return []
    if not core.batch_queue:  # only grammars compiling: wait a little, do not spin
        core.structured_output.wait_for_compiles(timeout_s=0.05)
        return []
    return fold_oldest_batch(core)


def fold_oldest_batch(core: EngineCore) -> list[EngineCoreOutput]:
    """Wait for the oldest micro-batch in flight and fold its sampled tokens in; returns its
    outputs. Its time from scheduling to now (when its requests can be scheduled again: their
    token interval) feeds the step-time model. A failed step fails every step in flight (the
    executor's error is raised)."""
    step = core.batch_queue.popleft()
    try:
        runner_output = step.future.result()
    except BaseException:
        core.scheduler.fail_steps([step.sched, *(s.sched for s in core.batch_queue)])
        core.batch_queue.clear()
        raise
    core.scheduler.record_noted_step_time(step.noted, time.perf_counter() - step.started)
    return core.scheduler.update_from_output(step.sched, runner_output)


def micro_batch_size(core: EngineCore, depth: int) -> int:
    """Requests per micro-batch: an even share of the unfinished ones (at least 1)."""
    return max(1, -(-(core.scheduler.num_running + core.scheduler.num_waiting) // depth))
