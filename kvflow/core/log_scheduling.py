"""The start-up log line of the scheduling options in force (``EngineCoreStartup``)."""

from __future__ import annotations

import logging

from kvflow.config import SchedulerConfig

# the line keeps the logger name it had when it lived in engine_startup.py
logger = logging.getLogger("kvflow.core.engine_startup")


def log_scheduling(sc: SchedulerConfig) -> None:
    """One start-up line saying which scheduling options are in force (policy, the limits of
    one step: ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens, service-level
    targets in ms, admission control, preemption mode, an idle batch window, a long-prefill
    threshold), so a user can check that flags took."""
    admission = ", admission control" if sc.admission_control else ""
    window = f"; idle batch window {sc.idle_batch_window_ms:g} ms" \
        if sc.idle_batch_window_ms else ""
    threshold = f"; at most {sc.long_prefill_token_threshold} tokens per request beside " \
        "others (long prefill threshold)" if sc.long_prefill_token_threshold else ""
    logger.info("scheduling: policy %s; at most %d requests and %s tokens per step; TTFT "
                "target %s, TPOT target %s%s; preemption %s%s%s", sc.policy, sc.max_num_seqs,
                sc.max_num_batched_tokens, _ms(sc.target_ttft_ms), _ms(sc.target_tpot_ms),
                admission, sc.preemption_mode, window, threshold)


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:g} ms"
