"""How engine-core processes start (kvflow/engine/start_method.py): forked by ``kvflow serve``
and ``run-batch`` run as their own process, spawned everywhere else, on a restart, where the
process can no longer fork safely, or as ``KVFLOW_WORKER_MULTIPROC_METHOD`` says. The server
side (a forked first core, a spawned restart, the variable's ``spawn``) is checked on real
processes in tests/e2e/test_engine_faults.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import types

import pytest

from kvflow.engine import start_method
from kvflow.engine.start_method import START_METHOD_VARIABLE, core_start_method, method_now


@pytest.mark.parametrize(("value", "fresh", "expected"), [
    (None, True, "fork"), (None, False, "spawn"), ("", True, "fork"),
    ("auto", True, "fork"), ("auto", False, "spawn"),
    ("spawn", True, "spawn"), ("spawn", False, "spawn"),
    ("fork", True, "fork"), ("fork", False, "fork"),
])
def test_the_variable_and_a_fresh_process_pick_the_method(monkeypatch, value, fresh, expected):
    if value is None:
        monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(START_METHOD_VARIABLE, value)
    assert core_start_method(fresh) == expected


def test_off_linux_cores_are_spawned(monkeypatch):
    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert core_start_method(True) == "spawn"


def test_a_bad_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(START_METHOD_VARIABLE, "forkserver")
    with pytest.raises(ValueError) as err:
        core_start_method(True)
    assert str(err.value) == ("KVFLOW_WORKER_MULTIPROC_METHOD='forkserver' is invalid; choose "
                              "one of ['auto', 'fork', 'spawn']")


def _quiet_process(monkeypatch) -> None:
    """This (pytest) process as a fresh ``kvflow serve`` sees it: one Python thread, no CUDA,
    no Ray."""
    monkeypatch.setattr(start_method.threading, "active_count", lambda: 1)
    monkeypatch.delitem(sys.modules, "ray", raising=False)


def test_fork_stays_fork_in_a_quiet_process(monkeypatch):
    _quiet_process(monkeypatch)
    assert method_now("fork") == "fork"
    assert method_now("spawn") == "spawn"


def test_a_running_thread_makes_it_spawn(monkeypatch):
    _quiet_process(monkeypatch)
    monkeypatch.undo()  # the real thread count, with one more thread running for sure
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert threading.active_count() >= 2
        assert method_now("fork") == "spawn"
    finally:
        release.set()
        thread.join()


def test_cuda_initialised_makes_it_spawn(monkeypatch):
    import torch

    _quiet_process(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert method_now("fork") == "spawn"


def test_ray_started_makes_it_spawn(monkeypatch):
    _quiet_process(monkeypatch)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    assert method_now("fork") == "spawn"
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    assert method_now("fork") == "fork"


def test_the_cli_refuses_a_bad_value_before_the_model_loads(tiny_chat_model):
    """One ``kvflow: error`` line and exit 2; no engine process is started (a model load
    would print the core's log lines)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", tiny_chat_model,
         "--host", "127.0.0.1", "--port", str(port)], check=False, capture_output=True,
        text=True, timeout=120, env={**os.environ, START_METHOD_VARIABLE: "forkserver"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [(
        "kvflow: error: KVFLOW_WORKER_MULTIPROC_METHOD='forkserver' is invalid; choose one of "
        "['auto', 'fork', 'spawn']")]
