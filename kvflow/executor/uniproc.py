"""Executor that runs one ModelRunner in the engine's own process."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvflow.models.model_resolver import ModelSource
from kvflow.platforms import Platform
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import GrammarBitmask, SchedulerOutput
from kvflow.worker.model_runner import ModelRunner


class UniprocExecutor:
    """Single-device executor: a thin seam where multi-process / multi-node executors plug in."""

    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 hf_config: Any, dtype: torch.dtype) -> None:
        self.runner = ModelRunner(config, platform, source, hf_config, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes the loaded model's weights occupy (as stored)."""
        return self.runner.weight_bytes

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV-cache spec, in model order."""
        return self.runner.get_kv_cache_spec()

    def determine_available_memory(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> int:
        """Bytes the device can give the KV cache (may run a profiling forward pass)."""
        return self.runner.determine_available_memory(kv_cache_groups)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV tensors of the pool the engine core sized.

        Raises:
            ValueError: if an explicitly sized cache does not fit in free memory.
        """
        self.runner.initialize_kv_cache(kv_cache_config)

    def capture_graphs(self, max_model_len: int) -> None:
        self.runner.capture_graphs(max_model_len)

    def execute_model(self, sched: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
                      ) -> ModelRunnerOutput:
        return self.runner.execute_model(sched, grammar_bitmask)
