"""The start-up line that states the scheduling options in force (a newcomer could not tell
whether --policy fair or --target-tpot-ms took effect)."""

from __future__ import annotations

import logging

from kvflow.config import SchedulerConfig
from kvflow.core.engine_startup import log_scheduling


def test_line_names_every_scheduling_option(caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        log_scheduling(SchedulerConfig(policy="fair", target_tpot_ms=80, target_ttft_ms=2000.5,
                                       admission_control=True, preemption_mode="swap",
                                       idle_batch_window_ms=20))
        log_scheduling(SchedulerConfig())
    assert [r.getMessage() for r in caplog.records] == [
        ("scheduling: policy fair; TTFT target 2000.5 ms, TPOT target 80 ms, admission control; "
         "preemption swap; idle batch window 20 ms"),
        "scheduling: policy fcfs; TTFT target none, TPOT target none; preemption recompute"]
