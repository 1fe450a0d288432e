"""A core frozen or stopped while it starts (before ``EngineReady``) fails the start-up within
``engine_heartbeat_timeout`` seconds (``core_client.wait_ready`` with
``core_heartbeat.StartupLiveness``), where it was only caught by ``--engine-start-timeout``
(600 s by default); a core still starting that runs (a slow import, a slow load) is not.

``wait_ready`` is driven with stand-in cores (real processes: ``sleep``, which uses no CPU,
stopped with SIGSTOP or not, a busy loop, which does, and a heartbeat thread that stops
beating), then ``kvflow serve`` itself with its core stopped before it is ready (was: the CLI
waited the 600 s). A starting core that holds its GIL but runs (a 3.5 s ``gc.collect`` of the
start-up heap on 2 busy cores, seen in tests/e2e/test_frozen_core.py) is no longer silent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvflow.engine.core_client import wait_ready
from kvflow.engine.core_heartbeat import start_core_heartbeat
from kvflow.engine.messages import EngineFailed, EngineHeartbeat, output_decoder
from tests.e2e.conftest import free_port
from tests.e2e.parent_death import with_parent_death
from tests.e2e.test_engine_faults import core_pid

BUSY = [sys.executable, "-c", "while True: pass"]


class _Core:
    """What ``wait_ready`` reads of a ``CoreProcess``, around a real process."""

    def __init__(self, index: int, proc: subprocess.Popen) -> None:
        self.index, self.proc, self.state, self.killed = index, proc, None, False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def output(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/output"
    pull.bind(address)
    yield pull, address
    pull.close(linger=0)
    ctx.term()


@pytest.fixture
def sleeper():
    procs = []

    def start(argv: list[str] | None = None) -> subprocess.Popen:
        procs.append(subprocess.Popen(argv or ["sleep", "60"]))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _wait(output, cores, timeout: float, heartbeat_timeout: float) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        wait_ready(output, output_decoder(), cores, timeout,
                   heartbeat_timeout=heartbeat_timeout)
    return str(info.value), time.monotonic() - start


def test_a_core_stopped_before_its_first_heartbeat_fails_the_start(output, sleeper):
    pull, _ = output
    running = _Core(0, sleeper(BUSY))  # loading: uses CPU, beats or not
    stopped = _Core(1, sleeper())
    os.kill(stopped.pid, signal.SIGSTOP)
    message, waited = _wait(pull, [running, stopped], 30.0, heartbeat_timeout=1.0)
    assert 1.0 < waited < 5.0  # was: the 30 s start timeout
    assert message.startswith(f"engine core 1 of 2 (pid {stopped.pid}) sent no heartbeat and "
                              "used no CPU for ")
    assert " s while starting (engine_heartbeat_timeout=1): the process is stopped " \
           "(SIGSTOP or SIGTSTP); its start-up was abandoned" in message
    assert stopped.killed and not running.killed


def test_a_core_whose_heartbeats_stop_while_it_loads_fails_the_start(output, sleeper):
    pull, address = output
    core = _Core(0, sleeper())  # sleeps for ever, as a deadlocked process does
    sender = start_core_heartbeat(0, address, timeout_s=1.0)
    time.sleep(0.6)
    sender.stop()  # as a C call holding the GIL stops the core's heartbeat thread
    message, waited = _wait(pull, [core], 30.0, heartbeat_timeout=1.0)
    assert waited < 5.0
    assert message.startswith(f"engine core (pid {core.pid}) sent no heartbeat and used no "
                              "CPU for ")
    assert "while starting (engine_heartbeat_timeout=1)" in message and core.killed


def test_a_core_that_beat_then_failed_and_exited_reports_its_error(output, sleeper):
    """Heartbeats, then the start-up's EngineFailed, then the process is gone, all before
    ``wait_ready`` reads a message: the error (a ValueError for bad input) is what is
    raised. Was: one message read per turn (the beat), then the dead process was reported
    as "exited with code 0 while starting" (tests/test_max_model_len_kv_cache.py's serve
    case failed so under CI load)."""
    pull, address = output
    proc = sleeper(["true"])
    proc.exitcode = proc.wait()  # multiprocessing's name, which the error message reads
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    encoder = msgspec.msgpack.Encoder()
    for msg in (EngineHeartbeat(0, time.monotonic()), EngineHeartbeat(0, time.monotonic()),
                EngineFailed("--max-model-len=64 does not fit the KV cache", bad_input=True)):
        push.send(encoder.encode(msg))
    while not pull.poll(50):
        pass
    with pytest.raises(ValueError, match="--max-model-len=64 does not fit the KV cache"):
        wait_ready(pull, output_decoder(), [_Core(0, proc)], 30.0, heartbeat_timeout=5.0)
    push.close(linger=0)


def test_a_core_that_runs_without_heartbeats_is_waited_for(output, sleeper):
    pull, address = output
    # a spawned core still importing, or one in a long gc.collect: runs, never beats
    slow = _Core(0, sleeper(BUSY))
    beating = _Core(1, sleeper())
    sender = start_core_heartbeat(1, address, timeout_s=0.4)
    try:
        message, waited = _wait(pull, [slow, beating], 4.0, heartbeat_timeout=0.8)
    finally:
        sender.stop()
    assert message == "engine core did not start within 4 s" and waited >= 4.0
    assert not slow.killed and not beating.killed


def _serve(model: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               HF_HUB_OFFLINE="1")
    return subprocess.Popen(with_parent_death(
        [sys.executable, "-m", "kvflow", "serve", model, "--port", str(port), "--dtype",
         "float32", "--num-kv-blocks", "32", "--engine-heartbeat-timeout", "2"]),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def test_kvflow_serve_with_its_core_stopped_while_starting_exits_naming_it(tiny_llama):
    server = _serve(tiny_llama.path, free_port())
    try:
        deadline, pid = time.monotonic() + 120, None
        while pid is None and time.monotonic() < deadline and server.poll() is None:
            try:
                pid = core_pid(server.pid)
            except AssertionError:
                time.sleep(0.01)
        assert pid is not None, "no engine core appeared"
        os.kill(pid, signal.SIGSTOP)  # forked, waiting for the go or loading: not ready
        stopped_at = time.monotonic()
        _, err = server.communicate(timeout=60)
        waited = time.monotonic() - stopped_at
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 1 and waited < 20  # was: 600 s (--engine-start-timeout)
    assert f"kvflow: error: engine core (pid {pid}) sent no heartbeat and used no CPU " in err
    assert "while starting (engine_heartbeat_timeout=2): the process is stopped" in err
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
