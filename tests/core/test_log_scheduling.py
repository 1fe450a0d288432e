"""The start-up line that states the scheduling options in force (a newcomer could not tell
whether --policy fair, --target-tpot-ms or --max-num-seqs took effect)."""

from __future__ import annotations

import logging

from kvflow.config import SchedulerConfig
from kvflow.core.log_scheduling import log_scheduling


def test_line_names_every_scheduling_option(caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        log_scheduling(SchedulerConfig(policy="fair", target_tpot_ms=80, target_ttft_ms=2000.5,
                                       admission_control=True, preemption_mode="swap",
                                       idle_batch_window_ms=20, max_num_seqs=3,
                                       max_num_batched_tokens=512))
        log_scheduling(SchedulerConfig(max_num_batched_tokens=2048))
        log_scheduling(SchedulerConfig(max_num_batched_tokens=2048,
                                       long_prefill_token_threshold=256))
    assert [r.getMessage() for r in caplog.records] == [
        ("scheduling: policy fair; at most 3 requests and 512 tokens per step; "
         "TTFT target 2000.5 ms, TPOT target 80 ms, admission control; "
         "preemption swap; idle batch window 20 ms"),
        ("scheduling: policy fcfs; at most 256 requests and 2048 tokens per step; TTFT target "
         "none, TPOT target none; preemption recompute"),
        ("scheduling: policy fcfs; at most 256 requests and 2048 tokens per step; TTFT target "
         "none, TPOT target none; preemption recompute; at most 256 tokens per request beside "
         "others (long prefill threshold)")]
