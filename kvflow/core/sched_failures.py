"""The scheduler's side of a request that failed alone inside a step
(``ModelRunnerOutput.failed``, recorded by ``kvflow/worker/request_failures.py``): that
request ends with its error, the step's other requests go on.

The step ran the failed request's tokens anyway (without its image, adapter or processor),
so the K/V it wrote are not what their block hashes say: the blocks only it holds leave the
prefix cache before they are freed (blocks shared with another request were written by an
earlier, complete step: a prefix hit). The images the step was to encode for it leave the
encoder-cache mirror (the runner kept none that failed), and its sampled tokens are dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvflow.engine_outputs import EngineCoreOutput
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import RequestFailure
from kvflow.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from kvflow.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


def end_failed_requests(sched: Scheduler, sched_out: SchedulerOutput,
                        failures: dict[str, RequestFailure], stale: set[str]
                        ) -> list[EngineCoreOutput]:
    """End each live request of ``failures`` (not one freed meanwhile: ``stale``, or
    finished) as aborted, with its error; returns their outputs (finish_reason ``abort``,
    ``error`` and ``error_field`` set, ``internal_error`` for an unexpected exception)."""
    outputs = []
    for rid, failure in failures.items():
        request = sched.requests.get(rid)
        if rid in stale or request is None or request.is_finished:
            continue
        logger.warning("request %s failed in its step, the others go on: %s", rid,
                       failure.message)
        _uncache_own_blocks(sched, request)
        lost = _scheduled_images(request, sched_out)
        sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if lost and sched.encoder is not None:
            sched.encoder.forget(lost)
        outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", error=failure.message,
                                        error_field=failure.field,
                                        internal_error=failure.internal))
    return outputs


def _uncache_own_blocks(sched: Scheduler, request: Request) -> None:
    """Take the blocks (group 0) that only ``request`` holds out of the prefix cache."""
    pool = sched.kv.pool
    own = {b for b in sched.kv.get_block_ids(request.request_id)[0]
           if b and pool.blocks[b].ref_cnt == 1}
    if own:
        sched.kv.uncache_blocks(own)


def _scheduled_images(request: Request, sched_out: SchedulerOutput) -> set[str]:
    """Identifiers of the images ``sched_out`` was to encode for ``request``."""
    indices = sched_out.scheduled_encoder_inputs.get(request.request_id, ())
    return {request.mm_features[i].identifier for i in indices} if indices else set()
