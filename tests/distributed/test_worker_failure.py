"""A worker process that dies mid-run: the engine names the rank, stops every other worker
within seconds (no hang, no orphan) and refuses further work with the same error. A worker
that finds the configuration does not fit the model while it starts is bad input: one line,
exit status 2."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.executor import ExecutorError

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def test_killed_worker_is_reported_and_the_rest_shut_down(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=256,
              tensor_parallel_size=2)
    executor = llm.engine.core.executor
    procs = list(executor._procs)
    victim = procs[1].pid
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)  # well inside the 8 x 200-token run
    timer.start()
    try:
        with pytest.raises(ExecutorError) as err:
            llm.generate([[5, 6, 7, 8]] * 8, LONG, use_tqdm=False)
        reported_after = time.monotonic() - killed_at[0]
    finally:
        timer.cancel()
        llm.shutdown()
    assert f"worker rank 1 (pid {victim}) died: killed by signal SIGKILL" in str(err.value)
    assert reported_after < 5.0
    assert all(p.poll() is not None for p in procs)  # rank 0 was stopped and reaped too
    with pytest.raises(ExecutorError, match="worker rank 1"):  # no silent half-engine
        llm.generate([[5, 6, 7]], LONG, use_tqdm=False)
    assert not os.path.exists(executor._dir)


def test_a_worker_start_up_value_error_is_one_cli_line_exit_2(tiny_llama, capfd):
    """A configuration the model does not fit, found only while the workers build their part
    (int4 groups of 64 columns, but TP=2 leaves o_proj 32 input columns per rank): ``kvflow
    generate`` exits 2 with one line naming what and why, as one process does with a
    ValueError; no worker traceback on stderr (was: every rank's traceback, then the
    engine's, exit 1)."""
    from kvflow.entrypoints.cli import main

    rc = main(["generate", "--model", tiny_llama.path, "--prompt", "hi", "--max-tokens", "2",
               "--dtype", "float32", "--tensor-parallel-size", "2", "--quantization", "int4",
               "--quantization-group-size", "64"])
    # warnings (KVFLOW_NATIVE_CPU=0: each rank's "attention backend 'cpu' unavailable") aside
    err = [line for line in capfd.readouterr().err.splitlines()
           if line.strip() and not line.startswith("WARNING ")]
    assert rc == 2 and len(err) == 1, err
    assert "quantization_group_size=64 does not divide the 32 input columns each of " \
           "tensor_parallel_size=2 ranks" in err[0]


class _OneReply:
    """A results socket holding one reply."""

    def __init__(self, *frames: bytes) -> None:
        self.frames = list(frames)

    def poll(self, timeout_ms: int) -> int:
        return 1

    def recv_multipart(self) -> list[bytes]:
        return self.frames


@pytest.mark.parametrize("steps_sent, is_value_error", [(0, True), (3, False)])
def test_a_value_error_during_engine_set_up_is_bad_input(monkeypatch, steps_sent,
                                                         is_value_error):
    """A worker's ValueError in the engine's set-up calls (before any step: e.g. a quantized
    KV cache for an MLA model, found when the KV cache is laid out) is raised as a ValueError
    naming the rank (was ExecutorError: a traceback and exit 1 from ``kvflow``); once steps
    run, a worker's error is an engine failure as before. No process: the executor's reply
    socket is replaced."""
    from kvflow.executor import WorkerConfigError
    from kvflow.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._failed, executor._procs, executor._sent = None, [], steps_sent
    executor._pull = _OneReply(b"error", b"1", b"ValueError: kv_cache_dtype='int8' is not "
                                               b"supported for MLA")
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    with pytest.raises(ExecutorError, match="kv_cache_dtype='int8' is not supported for MLA"
                       ) as err:
        executor._recv()
    assert isinstance(err.value, ValueError) is is_value_error
    assert isinstance(err.value, WorkerConfigError) is is_value_error
    assert ("worker rank 1, at engine start-up" in str(err.value)) is is_value_error


class _RayTaskError(Exception):
    """Ray's wrapper of an actor method's exception (the original is ``cause``)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::RayWorkerWrapper.init_worker() (pid=1)\n  Traceback: {cause}")
        self.cause = cause


class _FakeRay:
    """``ray.wait`` / ``ray.get`` over refs that are the values (or errors) themselves."""

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref: object) -> object:
        if isinstance(ref, BaseException):
            raise ref
        return ref


@pytest.mark.parametrize("steps_sent, is_value_error", [(0, True), (2, False)])
def test_ray_worker_value_error_at_start_up_is_bad_input(monkeypatch, steps_sent,
                                                         is_value_error):
    """Under ``--distributed-executor-backend ray`` a worker's ValueError while it builds its
    part of the model (or in the engine's set-up calls) is raised as WorkerConfigError naming
    the rank, so ``kvflow`` prints one line and exits 2 as with ``mp`` (was ExecutorError
    carrying Ray's task-error text: a traceback and exit 1); after the first step a worker's
    error is an engine failure. No Ray: its ``wait``/``get`` are faked."""
    from kvflow.executor import WorkerConfigError
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._failed, executor.ray, executor._sent = None, _FakeRay(), steps_sent
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    bad = ValueError("quantization_group_size=64 does not divide the 32 input columns")
    with pytest.raises(ExecutorError, match="does not divide the 32 input columns") as err:
        executor._wait([None, _RayTaskError(bad)], starting=steps_sent == 0)
    assert isinstance(err.value, WorkerConfigError) is is_value_error
    assert ("worker rank 1, at engine start-up" in str(err.value)) is is_value_error
    if is_value_error:
        assert str(err.value).startswith("quantization_group_size=64")  # no Ray task text
