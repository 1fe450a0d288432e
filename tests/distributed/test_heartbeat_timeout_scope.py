"""``--worker-heartbeat-timeout`` bounds how long a worker (executor ``mp``: a process;
``ray``: an actor) may go without a heartbeat; an engine without workers (``uni``: its one rank
in-process) never reads it, so a value other than the default is refused there instead of
being ignored."""

from __future__ import annotations

import importlib.util

import pytest

from kvflow.config.parallel import ParallelConfig


def test_in_process_engine_refuses_a_heartbeat_timeout():
    with pytest.raises(ValueError, match=r"^worker_heartbeat_timeout=5 applies to worker "
                                         r"processes \(distributed_executor_backend mp or ray\); "
                                         r"this engine's executor is uni"):
        ParallelConfig(worker_heartbeat_timeout=5.0)


def test_worker_processes_take_it_and_the_default_passes_everywhere():
    assert ParallelConfig(tensor_parallel_size=2,
                          worker_heartbeat_timeout=5.0).worker_heartbeat_timeout == 5.0
    assert ParallelConfig(distributed_executor_backend="mp",
                          worker_heartbeat_timeout=5.0).executor_backend == "mp"
    assert ParallelConfig().worker_heartbeat_timeout == 30.0  # uni, the default


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray not installed")
def test_ray_takes_it():
    """Ray actors send heartbeats too (was: refused, a stopped actor went unnoticed)."""
    assert ParallelConfig(distributed_executor_backend="ray", tensor_parallel_size=2,
                          worker_heartbeat_timeout=5.0).worker_heartbeat_timeout == 5.0
