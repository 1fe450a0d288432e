"""The engine core's counters as one :class:`~kvflow.engine_outputs.EngineStats` snapshot,
sent with each step's outputs (``core_proc``) or read in-process (``LLM.get_metrics``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from kvflow.engine_outputs import EngineStats
from kvflow.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvflow.core.engine_core import EngineCore

__all__ = ["collect_stats"]

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # a request in the waiting queue


def collect_stats(core: EngineCore) -> EngineStats:
    """Snapshot of the scheduler and KV-cache counters; takes the token counts of the steps
    and the phases of the requests finished since the previous snapshot
    (``Scheduler.take_iteration_tokens`` / ``take_finished_stats``): send what it returns."""
    kv, sched, enc = core.kv_cache_manager, core.scheduler, core.scheduler.encoder
    stats = EngineStats(sched.num_running, sched.num_waiting, kv.usage, kv.num_free_blocks,
                        kv.pool.num_usable_blocks, sched.num_preemptions, kv.num_queries,
                        kv.num_hits, core.weight_bytes, core.kv_bytes_per_token,
                        *((enc.num_queries, enc.num_hits, enc.num_encoded) if enc else ()))
    spec = getattr(core, "speculator", None)
    if spec is not None:
        stats.spec_decode_num_drafts = spec.num_drafts
        stats.spec_decode_num_draft_tokens = spec.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(spec.num_accepted_per_pos)
    model = sched.planner.model
    stats.step_time_predictions = model.num_predicted
    stats.step_time_abs_error_s = model.mean_abs_error
    stats.step_time_rel_error = model.mean_rel_error
    stats.iteration_tokens = sched.take_iteration_tokens()
    stats.finished_requests = sched.take_finished_stats()
    # a copy: the offline LLM reads the stats in-process, and /metrics counts what they grew
    stats.prompt_tokens = msgspec.structs.replace(sched.prompt_token_stats)
    stats.num_waiting_deferred = len(sched.deferred)
    if sched.max_loras is not None:  # LoRA enabled
        stats.running_lora_adapters = _adapter_names(sched.running)
        stats.waiting_lora_adapters = _adapter_names(  # the queue's, without sorting it
            r for r in sched.requests.values() if r.status in _WAITING)
    return stats


def _adapter_names(requests: Iterable[Request]) -> list[str]:
    """The names of the LoRA adapters ``requests`` run with, sorted, each once."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
