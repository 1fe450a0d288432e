"""The pieces of engine-core liveness (``kvflow/engine/core_heartbeat.py``), without an engine:
``CoreLiveness`` on hand-made clocks, the heartbeat message through the API process's decoder,
a core's beats sent by its thread, and ``engine_heartbeat_timeout``'s check. The processes
themselves: tests/test_core_liveness.py, tests/distributed/test_data_parallel_frozen.py and
tests/e2e/test_frozen_core.py."""

from __future__ import annotations

import itertools
import math
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from kvflow.config.parallel import ParallelConfig
from kvflow.engine.core_client import ReplicaState
from kvflow.engine.core_heartbeat import CoreLiveness, heartbeat_interval, start_core_heartbeat
from kvflow.engine.messages import EngineHeartbeat, output_decoder


def _core(live: bool = True, pid: int | None = None, index: int = 0,
          state: ReplicaState | None = None) -> SimpleNamespace:
    state = state or (ReplicaState.LIVE if live else ReplicaState.DEAD)
    core = SimpleNamespace(is_live=live, pid=pid, killed=False, index=index, state=state,
                           is_alive=state is not ReplicaState.DEAD)
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
        assert why == (f"engine core 1 of 2 (pid {proc.pid}) sent no heartbeat and "
                       "used no CPU for 2.3 s "
                       "(engine_heartbeat_timeout=2): the process is stopped (SIGSTOP or "
                       "SIGTSTP)")
        assert core.killed
    finally:
        proc.kill()
        proc.wait()


def _restarting(proc: subprocess.Popen, index: int) -> SimpleNamespace:
    """A replica whose new process (``proc``) is starting: alive, not live."""
    return _core(live=False, pid=proc.pid, index=index, state=ReplicaState.STARTING)


def test_a_restarted_core_that_neither_beats_nor_runs_is_found_while_starting():
    """``--engine-failure restart``: a new core stopped before its ``EngineReady`` is found by
    the start-up rule within the timeout. Was: ``silent`` judged live replicas only, so it
    was waited for until ``--engine-start-timeout`` (600 s)."""
    stopped = subprocess.Popen(["sleep", "30"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # loading: runs
    try:
        stopped.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        liveness = CoreLiveness(3, 1.0, now=start)
        cores = [_core(index=0), _restarting(stopped, 1), _restarting(busy, 2)]
        found, now = [], start
        while not found and now - start < 5.0:
            time.sleep(0.25)  # the output loop's checks
            now = time.monotonic()
            liveness.beat(EngineHeartbeat(0, now))  # replica 0 serves and beats
            found = liveness.silent(cores, now)
        assert [core for core, _ in found] == [cores[1]]
        assert 1.0 < found[0][1] < 2.0 and now - start < 2.5
        why = liveness.declare_dead(cores[1], found[0][1], "engine core 2 of 3")
        assert why.startswith(f"engine core 2 of 3 (pid {stopped.pid}) sent no heartbeat and "
                              "used no CPU for 1.")
        assert why.endswith(" s while starting (engine_heartbeat_timeout=1): the process is "
                            "stopped (SIGSTOP or SIGTSTP)")
        assert cores[1].killed and not cores[2].killed
    finally:
        for proc in (stopped, busy):
            proc.kill()
            proc.wait()


def test_a_restart_is_judged_from_its_new_process_start():
    """A replica restarted long after the liveness began (its old process's silence is not
    the new one's) and a second restart of the same replica (a new pid: judged anew)."""
    first, second = subprocess.Popen(["sleep", "30"]), subprocess.Popen(["sleep", "30"])
    try:
        liveness = CoreLiveness(1, 2.0, now=100.0)
        for t in (100.5, 101.0, 101.5):
            liveness.beat(EngineHeartbeat(0, t))
            assert liveness.silent([_core()], t) == []
        # the replica died at 101.5 and its new process appears at 150 (checks went on)
        for t in [101.5 + 0.5 * i for i in range(1, 98)]:
            assert liveness.silent([_core(live=False)], t) == []
        core = _restarting(first, 0)
        for t in (150.0, 150.5, 151.0, 151.5):  # heard from at its first sight, 150 s
            assert liveness.silent([core], t) == []
        assert [s for _, s in liveness.silent([core], 152.1)] == [pytest.approx(2.1)]
        again = _restarting(second, 0)
        assert liveness.silent([again], 152.2) == []  # another process: judged from now
    finally:
        for proc in (first, second):
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


# A core whose step holds the GIL for HOLD_S seconds while it computes (as one long C call
# does: a full gc.collect of a large heap, an extension that keeps the GIL): the switch
# interval set past the hold keeps the busy main thread from handing the GIL to the
# heartbeat thread, which beats every 0.1 s before and after. Plain zmq, no kvflow: a
# spawned core's imports would take seconds on a busy machine.
HOLD_S = 3.0
GIL_HOLDER = f"""
import sys, threading, time, zmq
push = zmq.Context().socket(zmq.PUSH)
push.connect(sys.argv[1])
def beat():
    while True:
        push.send_string(repr(time.monotonic()))
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
time.sleep(0.5)
sys.setswitchinterval(100.0)
end = time.monotonic() + {HOLD_S}
while time.monotonic() < end:
    pass
sys.setswitchinterval(0.005)
time.sleep(60)
"""


def test_a_live_core_whose_step_holds_the_gil_is_not_taken_for_frozen(tmp_path):
    """Was: a live replica was judged by its heartbeats alone, so a step that held the GIL
    for longer than ``engine_heartbeat_timeout`` (1 s here) had the core killed and its
    requests failed. Now a live core that used CPU time since the previous check is heard
    from; a stopped one beside it (SIGSTOP: no beats, no CPU) is still found."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/beats"
    pull.bind(address)
    holder = subprocess.Popen([sys.executable, "-c", GIL_HOLDER, address])
    stopped = subprocess.Popen(["sleep", "30"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        assert pull.poll(30_000)  # the holder runs and beats: its hold starts 0.5 s later
        start = time.monotonic()
        liveness = CoreLiveness(2, 1.0, now=start)
        cores = [_core(pid=holder.pid, index=0), _core(pid=stopped.pid, index=1)]
        stamps, found, now = [], [], start
        while now - start < HOLD_S + 1.0:
            time.sleep(liveness.check_interval_s)  # the output loop's checks
            while pull.poll(0):
                stamps.append(float(pull.recv_string()))
                liveness.beat(EngineHeartbeat(0, stamps[-1]))
            now = time.monotonic()
            found += [(core.index, silent_s) for core, silent_s in liveness.silent(cores, now)]
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert max(gaps) > HOLD_S - 0.6, gaps  # the holder's beats did stop (GIL held)
        assert stamps[-1] > start + HOLD_S - 0.5  # and came back after the hold
        assert [index for index, _ in found] == [1] * len(found) and found, found
        assert 1.0 < found[0][1] < 1.5, found  # the stopped one: at its first check past 1 s
    finally:
        for proc in (holder, stopped):
            proc.kill()
            proc.wait()
        pull.close(linger=0)
        ctx.term()
