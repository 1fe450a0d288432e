"""Executors: run the engine's workers (``base.py`` the interface; ``uniproc`` in-process,
``multiproc`` one process per rank, ``ray`` one Ray actor per rank)."""

from __future__ import annotations

from typing import Any

from kvflow.config import EngineConfig
from kvflow.executor.base import Executor, ExecutorError, StepFuture, WorkerConfigError


def make_executor(config: EngineConfig, source: Any, hf_config: Any, dtype: Any) -> Executor:
    """The executor ``config.parallel_config.executor_backend`` names, started (its workers
    have loaded the model).

    Raises:
        ValueError: for a bad model or configuration (from a worker process:
            :class:`WorkerConfigError`, also an ExecutorError), or ``ray`` without Ray
            installed.
        ExecutorError: if a worker process fails to start for another reason.
    """
    backend = config.parallel_config.executor_backend
    if backend == "uni":
        from kvflow.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, source, hf_config, dtype)
    if backend == "mp":
        from kvflow.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source, hf_config, dtype)
    from kvflow.executor.ray import RayExecutor

    return RayExecutor(config, source, hf_config, dtype)


__all__ = ["Executor", "ExecutorError", "StepFuture", "WorkerConfigError", "make_executor"]
