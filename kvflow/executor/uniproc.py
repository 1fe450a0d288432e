"""Executor that runs one ModelRunner in the engine's own process."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.models.model_resolver import ModelSource
from kvflow.platforms import Platform
from kvflow.runner_output import SampledToken
from kvflow.sched_output import GrammarBitmask, SchedulerOutput
from kvflow.worker.model_runner import ModelRunner


class UniprocExecutor:
    """Single-device executor: a thin seam where multi-process / multi-node executors plug in."""

    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 hf_config: Any, dtype: torch.dtype) -> None:
        self.runner = ModelRunner(config, platform, source, hf_config, dtype)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """Sliding window (None = full attention) of each KV-cache group."""
        return self.runner.kv_group_windows

    def capture_graphs(self, max_model_len: int) -> None:
        self.runner.capture_graphs(max_model_len)

    def execute_model(self, sched: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
                      ) -> dict[str, SampledToken]:
        return self.runner.execute_model(sched, grammar_bitmask)
