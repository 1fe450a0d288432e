"""Warnings about settings an engine does not read are logged once per engine, not once per
worker rank: the ``--deterministic`` ones (``KVFLOW_CPU_GEMM`` other than native,
``KVFLOW_CPU_ATTENTION`` without a draft model, ``--cpu-adaptive-threads``) by the engine core,
of data-parallel replica 0 only; why the adaptive thread count is off, and more threads than
CPUs, by rank 0 of replica 0. Before, a pipeline-parallel engine's every worker logged them.
In one process (the uni executor) they are still logged, once (tests/test_deterministic.py
checks the exact lines there)."""

from __future__ import annotations

import logging
import os

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.core.unread_options import warn_unread_settings
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_threads import AdaptiveThreads, check_cpu_threads
from kvflow.platforms.cpu import CpuPlatform

GEMM_UNREAD = ("KVFLOW_CPU_GEMM='onednn' is not read under --deterministic, which runs kvflow's "
               "C GEMM (native) for every projection and the LM head; unset it")
ADAPTIVE_OFF = "--cpu-adaptive-threads is off: not available with --deterministic"

needs_native = pytest.mark.skipif(native_cpu_kernels() is None,
                                  reason="--deterministic needs kvflow's native CPU kernels")


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_the_deterministic_warnings_come_from_replica_0_only(monkeypatch, caplog):
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "onednn")
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("KVFLOW_CPU_ATTENTION", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        for rank in (0, 1):
            warn_unread_settings(EngineConfig.from_kwargs(
                model="m", deterministic=True, data_parallel_size=2, data_parallel_rank=rank),
                CpuPlatform())
    assert _messages(caplog) == [GEMM_UNREAD, ADAPTIVE_OFF]


def test_adaptive_threads_off_is_logged_by_the_rank_told_to(caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        assert AdaptiveThreads.create(True, 2, pinned=True, ranks=1, warn=False) is None
        assert AdaptiveThreads.create(True, 2, pinned=False, ranks=2, warn=False) is None
        assert _messages(caplog) == []
        assert AdaptiveThreads.create(True, 2, pinned=False, ranks=2) is None
    assert _messages(caplog) == [
        "--cpu-adaptive-threads is off: not available with 2 worker processes"]


def test_too_many_threads_is_logged_by_the_replica_told_to(caplog, monkeypatch):
    """2 threads for each of 2 worker processes on a 3-CPU mask: one warning, from the
    replica told to warn."""
    from kvflow.kernels import cpu_threads

    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: [0, 1, 2])
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        check_cpu_threads(2, None, 2, warn=False)
        assert _messages(caplog) == []
        check_cpu_threads(2, None, 2)
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "cpu_threads=2 for each of 2 worker process(es) exceeds the 3 CPUs ")


def _counts_everywhere(lines: list[str], caplog, capfd) -> list[int]:
    """How often each line was logged: records of this process (caplog) plus lines the worker
    processes wrote to stderr."""
    err = capfd.readouterr().err.splitlines()
    return [_messages(caplog).count(line) + sum(line in e for e in err) for line in lines]


@needs_native
def test_a_pipeline_parallel_engine_warns_once(tiny_llama, monkeypatch, caplog, capfd):
    """Two pipeline stages, two worker processes: each line once (each worker logged the
    --deterministic ones before)."""
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "onednn")
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("KVFLOW_CPU_ATTENTION", raising=False)
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", deterministic=True,
                  pipeline_parallel_size=2, num_kv_blocks=32, enforce_eager=True)
        out = llm.generate([[5, 17, 42]], SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        llm.shutdown()
    assert _counts_everywhere([GEMM_UNREAD, ADAPTIVE_OFF], caplog, capfd) == [1, 1]


def test_each_rank_of_two_sets_its_threads_and_only_rank_0_says_why_adaptive_is_off(
        monkeypatch, caplog):
    """What each worker of a two-rank engine runs at start-up (``configure_runner_threads``,
    the CPU thread sizing stubbed): both get no adaptive governor, and only rank 0 logs why.
    The two-worker engine run of the same line is in scripts/test_distributed_slow.sh."""
    from types import SimpleNamespace

    from kvflow.kernels.cpu_threads import CallerPin
    from kvflow.worker import cpu_setup

    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    sized = []

    def size(threads, bind, rank, ranks, gemm_pool, pin_by_default):
        sized.append((threads, rank, ranks, pin_by_default))
        return 2, None, CallerPin(None)  # two threads, unpinned

    monkeypatch.setattr(cpu_setup, "configure_cpu_threads", size)
    config = EngineConfig.from_kwargs(model="m", cpu_threads=2, pipeline_parallel_size=2)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        for rank in (0, 1):
            parallel = SimpleNamespace(world=SimpleNamespace(world_size=2), rank=rank)
            assert cpu_setup.configure_runner_threads(config, parallel)[0] is None
    assert sized == [(2, 0, 2, False), (2, 1, 2, False)]  # unpinned: the adaptive count is on
    assert _messages(caplog) == [
        "--cpu-adaptive-threads is off: not available with 2 worker processes"]


@pytest.mark.distributed_slow
@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                    reason="slow: run scripts/test_distributed_slow.sh")
@needs_native
def test_a_pipeline_parallel_engine_says_once_why_adaptive_is_off(tiny_llama, monkeypatch,
                                                                   caplog, capfd):
    """Two worker processes with two threads each, unpinned: the line once. In
    scripts/test_distributed_slow.sh (two worker processes: seconds); the default run keeps
    the workers' start-up step (above) and the pipeline-parallel engine with
    --deterministic."""
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("KVFLOW_CPU_ATTENTION", raising=False)
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", cpu_threads=2,
                  pipeline_parallel_size=2, num_kv_blocks=32, enforce_eager=True)
        llm.shutdown()
    assert _counts_everywhere([("--cpu-adaptive-threads is off: not available with 2 worker "
                               "processes")], caplog, capfd) == [1]
