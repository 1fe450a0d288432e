"""Engine-core heartbeats: a stopped or frozen engine-core process is found in seconds.

A core process that is alive but does not run (``SIGSTOP``, a debugger, a machine that swaps,
a C call that holds the GIL) has no exit status to poll and reports no error: its callers
waited for ever (a stream never ended, ``/health`` said 200, the data-parallel balancer kept
sending it requests). So each core, from the moment it runs (before it waits for the API
process's config check, loads the model and allocates its KV cache), sends an
``EngineHeartbeat`` every
:data:`~kvflow.executor.heartbeat.HEARTBEAT_INTERVAL_S` (capped to a quarter of the timeout)
from a thread of its own (:func:`start_core_heartbeat`; it runs during long steps too: torch
releases the GIL) over a PUSH socket of its own to the API process's output socket. The API
process (``OutputLoop`` for ``AsyncLLM``, ``DPCoreClient`` for the offline ``LLM``) records
them in a :class:`CoreLiveness` and checks it between messages; a live replica silent for
longer than ``engine_heartbeat_timeout`` seconds is taken for dead: its requests fail, it is
killed (a frozen process would hold its device and, resumed, answer for requests already
failed) and no longer chosen. While the API process waits for the cores' ``EngineReady``
(``core_client.wait_ready``), a :class:`StartupLiveness` judges the same way, so a core
frozen while it loads fails the start-up within ``engine_heartbeat_timeout`` seconds, not at
``--engine-start-timeout`` (600 s); before a core's first heartbeat (a spawned core still
importing torch) only a process that does not run (stopped, traced, in uninterruptible
sleep) for that long is.

The steps themselves pay nothing: the thread wakes once a second for a few microseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvflow.engine.messages import EngineHeartbeat
from kvflow.executor.heartbeat import (
    HEARTBEAT_INTERVAL_S,
    HeartbeatMonitor,
    HeartbeatSender,
    process_state,
)

if TYPE_CHECKING:  # core_client imports core_proc, which imports this module
    from kvflow.engine.core_client import CoreProcess


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between a core's heartbeats for a ``timeout_s`` (seconds) timeout: one a
    second, at least four per timeout."""
    return min(HEARTBEAT_INTERVAL_S, timeout_s / 4)


def _encode(engine_index: int, stamp: float) -> bytes:
    return msgspec.msgpack.encode(EngineHeartbeat(engine_index, stamp))  # thread-safe


def start_core_heartbeat(engine_index: int, output_addr: str,
                         timeout_s: float) -> HeartbeatSender:
    """Start a core's heartbeat thread (its own zmq context and socket, connected to
    ``output_addr``); the caller stops it (``HeartbeatSender.stop``) on the way out."""
    sender = HeartbeatSender(engine_index, output_addr, heartbeat_interval(timeout_s), _encode)
    sender.start()
    return sender


class CoreLiveness:
    """The API process's view of its replicas' heartbeats.

    Args:
        num_replicas: the data-parallel replicas (1 without data parallelism).
        timeout_s: ``engine_heartbeat_timeout`` (seconds).
        now: the current ``time.monotonic()``; every replica counts as heard from then.

    A check that comes more than ``timeout_s / 2`` after the previous one (the API process
    did not look: an offline ``LLM`` sat idle, or this process was stopped too) counts every
    replica as heard from at that moment instead of judging stale stamps
    (``HeartbeatMonitor``); hence :attr:`check_interval_s`.
    """

    def __init__(self, num_replicas: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.check_interval_s = heartbeat_interval(timeout_s)  # how often to call silent()
        self._monitor = HeartbeatMonitor(num_replicas, timeout_s, now)

    def beat(self, msg: EngineHeartbeat) -> None:
        """Record a heartbeat."""
        self._monitor.beat(msg.engine_index, msg.stamp)

    def heard(self, engine_index: int, now: float) -> None:
        """Replica ``engine_index`` (re)started at ``now`` (its ``EngineReady``)."""
        self._monitor.beat(engine_index, now)

    def silent(self, cores: list[CoreProcess], now: float) -> list[tuple[CoreProcess, float]]:
        """(core, seconds since its last heartbeat) of each live replica silent for longer
        than the timeout as of ``now`` (call after recording the heartbeats received)."""
        silent = self._monitor.silent_ranks(now)
        return [(cores[i], s) for i, s in silent if cores[i].is_live]

    def declare_dead(self, core: CoreProcess, silent_s: float, name: str) -> str:
        """Kill ``core`` (found silent for ``silent_s`` seconds) and return why, for its
        error: ``"{name} (pid P) sent no heartbeat for 2.1 s (engine_heartbeat_timeout=2):
        the process is stopped (SIGSTOP or SIGTSTP)"``. The caller marks it dead."""
        return declare_dead(core, silent_s, name, self.timeout_s)


def declare_dead(core: CoreProcess, silent_s: float, name: str, timeout_s: float,
                 when: str = "") -> str:
    """Kill ``core`` (silent for ``silent_s`` seconds) and return why, naming it and its
    process state (``CoreLiveness.declare_dead``); ``when``: words after the silence
    (" while starting")."""
    state = None if core.pid is None else process_state(core.pid)
    core.kill()
    return (f"{name} (pid {core.pid}) sent no heartbeat for {silent_s:.1f} s{when} "
            f"(engine_heartbeat_timeout={timeout_s:g})"
            + ("" if state is None else f": the process is {state}"))


class StartupLiveness:
    """``wait_ready``'s view of the cores that have not reported ready yet.

    Args:
        num_replicas: the data-parallel replicas.
        timeout_s: ``engine_heartbeat_timeout`` (seconds).
        now: the current ``time.monotonic()``; every replica counts as heard from then.

    A core that has sent a heartbeat is judged by them, as a ready one is (it stopped, or a
    C call holds its GIL, while it loads). One that has not yet (a spawned core imports
    torch and the engine before its first) counts as heard from at every check that finds
    its process running (``process_state`` None), so only one stopped, traced or in
    uninterruptible sleep for ``timeout_s`` is silent: a slow import never is.
    """

    def __init__(self, num_replicas: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._monitor = HeartbeatMonitor(num_replicas, timeout_s, now)
        self._beating = [False] * num_replicas

    def beat(self, msg: EngineHeartbeat) -> None:
        """Record a heartbeat."""
        if 0 <= msg.engine_index < len(self._beating):
            self._beating[msg.engine_index] = True
            self._monitor.beat(msg.engine_index, msg.stamp)

    def silent(self, starting: list[CoreProcess], now: float) -> list[tuple[CoreProcess, float]]:
        """(core, seconds of silence) of each of ``starting`` (the cores not ready yet,
        their processes alive) silent for longer than the timeout as of ``now``."""
        for core in starting:
            if not self._beating[core.index] and core.pid is not None \
                    and process_state(core.pid) is None:
                self._monitor.beat(core.index, now)
        by_index = {core.index: core for core in starting}
        return [(by_index[i], s) for i, s in self._monitor.silent_ranks(now) if i in by_index]
