"""The pieces of engine-core liveness (``kvflow/engine/core_heartbeat.py``), without an engine:
``CoreLiveness`` on hand-made clocks, the heartbeat message through the API process's decoder,
a core's beats sent by its thread, and ``engine_heartbeat_timeout``'s check. The processes
themselves: tests/test_core_liveness.py, tests/distributed/test_data_parallel_frozen.py and
tests/e2e/test_frozen_core.py."""

from __future__ import annotations

import math
import signal
import subprocess
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from kvflow.config.parallel import ParallelConfig
from kvflow.engine.core_heartbeat import CoreLiveness, heartbeat_interval, start_core_heartbeat
from kvflow.engine.messages import EngineHeartbeat, output_decoder


def _core(live: bool = True, pid: int | None = None) -> SimpleNamespace:
    core = SimpleNamespace(is_live=live, pid=pid, killed=False)
    core.kill = lambda: setattr(core, "killed", True)
    return core


def test_a_live_replica_silent_past_the_timeout_is_found_and_only_it():
    cores = [_core(), _core(), _core(live=False)]  # replica 2 dead already: never reported
    liveness = CoreLiveness(3, 2.0, now=100.0)
    assert liveness.check_interval_s == 0.5
    for t in (100.5, 101.0, 101.5, 102.0, 102.5):  # checks every 0.5 s; replica 0 beats
        liveness.beat(EngineHeartbeat(0, t))
        assert liveness.silent(cores, t) == ([(cores[1], t - 100.0)] if t > 102.0 else [])


def test_a_late_check_counts_everyone_heard_and_a_restart_is_heard():
    cores = [_core()]
    liveness = CoreLiveness(1, 2.0, now=100.0)
    assert liveness.silent(cores, 110.0) == []  # 10 s unchecked (idle LLM): not judged
    assert [s for _, s in liveness.silent(cores, 112.1 - 0.05)] == []
    liveness.heard(0, 200.0)  # EngineReady of a restarted core
    assert liveness.silent(cores, 201.0) == []


def test_declare_dead_names_a_stopped_process_and_kills_it():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        core = _core(pid=proc.pid)
        why = CoreLiveness(1, 2.0, 0.0).declare_dead(core, 2.26, "engine core 1 of 2")
        assert why == (f"engine core 1 of 2 (pid {proc.pid}) sent no heartbeat for 2.3 s "
                       "(engine_heartbeat_timeout=2): the process is stopped (SIGSTOP or "
                       "SIGTSTP)")
        assert core.killed
    finally:
        proc.kill()
        proc.wait()


def test_a_cores_thread_beats_on_the_output_socket(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/output"  # the thread has a zmq context of its own
    pull.bind(address)
    sender = start_core_heartbeat(1, address, timeout_s=0.2)  # one every 0.05 s
    try:
        decoder = output_decoder()
        beats = [decoder.decode(pull.recv()) for _ in range(3) if pull.poll(5000)]
    finally:
        sender.stop()
        pull.close(linger=0)
        ctx.term()
    assert len(beats) == 3
    assert all(isinstance(b, EngineHeartbeat) and b.engine_index == 1 for b in beats)
    assert beats[0].stamp < beats[1].stamp < beats[2].stamp <= time.monotonic()
    assert beats[2].stamp - beats[0].stamp >= 0.09
    assert output_decoder().decode(msgspec.msgpack.encode(EngineHeartbeat(0, 1.5))) == \
        EngineHeartbeat(0, 1.5)


def test_heartbeat_interval_and_the_timeouts_check():
    assert heartbeat_interval(30.0) == 1.0 and heartbeat_interval(2.0) == 0.5
    assert ParallelConfig().engine_heartbeat_timeout == 30.0
    assert ParallelConfig(engine_heartbeat_timeout=5.0).engine_heartbeat_timeout == 5.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"^engine_heartbeat_timeout=\S+ must be > 0 "
                                             r"\(seconds\)$"):
            ParallelConfig(engine_heartbeat_timeout=bad)
