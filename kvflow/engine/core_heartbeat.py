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
them in a :class:`CoreLiveness` and checks it between messages; a live replica that neither
sent a heartbeat nor used CPU time (:class:`CpuProgress`) for longer than
``engine_heartbeat_timeout`` seconds is taken for dead: its requests fail, it is
killed (a frozen process would hold its device and, resumed, answer for requests already
failed) and no longer chosen. While the API process waits for the cores' ``EngineReady``
(``core_client.wait_ready``), a :class:`StartupLiveness` judges the same way, so a core
frozen while it loads fails the start-up within ``engine_heartbeat_timeout`` seconds, not at
``--engine-start-timeout`` (600 s); there a core that uses CPU time counts as heard from (a
start-up's long C calls hold the GIL: the heap's full collection, a spawned core's imports).
A core restarted while the server runs (``--engine-failure restart``) is judged by the same
start-up rule until its ``EngineReady`` (:class:`CoreLiveness`; was: only
``--engine-start-timeout``).

A step that holds the GIL (one long C call: a full ``gc.collect`` of a large heap, a kernel or
extension that does not release it) stops the heartbeat thread for as long, but the process
runs: its CPU time counts as being heard from, so such a step is not a frozen core however
long it takes (was: a step holding the GIL past the timeout had the core killed and its
requests failed). A process that does not run (stopped, traced, deadlocked) uses none.

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

    A live replica that used CPU time since the previous check (``CpuProgress``) counts as
    heard from at that check: its heartbeat thread may wait for the GIL that a long step
    holds.

    A replica whose new process is starting (a restart: alive, not live yet) is judged by the
    start-up rule (:class:`StartupLiveness`: silent when it neither beats nor uses CPU time),
    from the first check that sees that process.
    """

    def __init__(self, num_replicas: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.check_interval_s = heartbeat_interval(timeout_s)  # how often to call silent()
        self._monitor = HeartbeatMonitor(num_replicas, timeout_s, now)
        self._startup = StartupLiveness(num_replicas, timeout_s, now)
        self._progress = CpuProgress(num_replicas)  # of the live replicas
        self._starting_pids: list[int | None] = [None] * num_replicas  # judged by _startup

    def beat(self, msg: EngineHeartbeat) -> None:
        """Record a heartbeat."""
        self._monitor.beat(msg.engine_index, msg.stamp)
        self._startup.beat(msg)

    def heard(self, engine_index: int, now: float) -> None:
        """Replica ``engine_index`` (re)started at ``now`` (its ``EngineReady``)."""
        self._monitor.beat(engine_index, now)

    def silent(self, cores: list[CoreProcess], now: float) -> list[tuple[CoreProcess, float]]:
        """(core, seconds of silence) of each live replica that neither beat nor ran for
        longer than the timeout as of ``now`` (call after recording the heartbeats
        received), then of each starting one (alive, not live: a restart) that did neither
        for that long."""
        from kvflow.engine.core_client import ReplicaState  # it imports this module

        for core in cores:
            if core.is_live and core.pid is not None and self._progress.ran(core.index,
                                                                            core.pid):
                self._monitor.beat(core.index, now)
        silent = self._monitor.silent_ranks(now)
        live = [(cores[i], s) for i, s in silent if cores[i].is_live]
        starting = [c for c in cores if c.state is ReplicaState.STARTING and c.is_alive]
        for core in starting:
            if self._starting_pids[core.index] != core.pid:  # a new process: judged from now
                self._starting_pids[core.index] = core.pid
                self._startup.restarted(core.index, now)
        return live + self._startup.silent(starting, now)

    def declare_dead(self, core: CoreProcess, silent_s: float, name: str) -> str:
        """Kill ``core`` (found silent for ``silent_s`` seconds) and return why, for its
        error: ``"{name} (pid P) sent no heartbeat and used no CPU for 2.1 s
        (engine_heartbeat_timeout=2): the process is stopped (SIGSTOP or SIGTSTP)"`` (a
        starting core's: ``"... for 2.1 s while starting ..."``). The caller marks it
        dead."""
        return declare_dead(core, silent_s, name, self.timeout_s, starting=not core.is_live)


def declare_dead(core: CoreProcess, silent_s: float, name: str, timeout_s: float,
                 starting: bool = False) -> str:
    """Kill ``core`` (it neither beat nor ran for ``silent_s`` seconds) and return why,
    naming it and its process state (``CoreLiveness.declare_dead``); ``starting``: found by
    :class:`StartupLiveness` (``"... sent no heartbeat and used no CPU for 2.1 s while
    starting (engine_heartbeat_timeout=2) ..."``)."""
    state = None if core.pid is None else process_state(core.pid)
    core.kill()
    when = " while starting" if starting else ""
    return (f"{name} (pid {core.pid}) sent no heartbeat and used no CPU for {silent_s:.1f} s"
            f"{when} (engine_heartbeat_timeout={timeout_s:g})"
            + ("" if state is None else f": the process is {state}"))


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time process ``pid`` has used, in clock ticks (``/proc/<pid>/stat``
    fields 14-15, Linux), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class CpuProgress:
    """Whether each replica's process ran between two looks: used CPU time (``cpu_ticks``,
    whole clock ticks, so under 10 ms of it may go unseen) or waits for its disk (``D``
    state). A stopped (SIGSTOP), traced or deadlocked process does neither.

    Args:
        num_replicas: the data-parallel replicas.
    """

    def __init__(self, num_replicas: int) -> None:
        self._last: list[tuple[int, int | None] | None] = [None] * num_replicas  # (pid, ticks)

    def forget(self, index: int) -> None:
        """Replica ``index`` has a new process: its CPU time is counted from the next look."""
        self._last[index] = None

    def ran(self, index: int, pid: int) -> bool:
        """Whether process ``pid`` (replica ``index``) used CPU time since the previous look
        at that process (False at the first look) or is waiting for I/O."""
        ticks, last = cpu_ticks(pid), self._last[index]
        self._last[index] = (pid, ticks)
        before = last[1] if last is not None and last[0] == pid else None
        io_wait = process_state(pid) == "in uninterruptible sleep (I/O)"
        return io_wait or (ticks is not None and before is not None and ticks > before)


class StartupLiveness:
    """``wait_ready``'s view of the cores that have not reported ready yet.

    Args:
        num_replicas: the data-parallel replicas.
        timeout_s: ``engine_heartbeat_timeout`` (seconds).
        now: the current ``time.monotonic()``; every replica counts as heard from then.

    A starting core may hold the GIL for seconds in one C call (the start-up heap's full
    ``gc.collect``: 3.5 s on 2 busy cores; importing torch, in a spawned core, before its
    heartbeat thread starts), so silence alone does not mean frozen here. A core counts as
    heard from at a heartbeat, and at every check that finds it has used CPU time since the
    previous one (``cpu_ticks``) or waits for its disk (``D`` state): it is silent only when
    it neither beats nor runs, as a stopped (SIGSTOP), traced or deadlocked process does.
    Where ``/proc`` cannot be read, heartbeats alone decide.
    """

    def __init__(self, num_replicas: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._monitor = HeartbeatMonitor(num_replicas, timeout_s, now)
        self._progress = CpuProgress(num_replicas)

    def beat(self, msg: EngineHeartbeat) -> None:
        """Record a heartbeat."""
        self._monitor.beat(msg.engine_index, msg.stamp)

    def restarted(self, index: int, now: float) -> None:
        """Replica ``index`` has a new process, started by ``now``: heard from then, its CPU
        time counted from the next check."""
        self._monitor.beat(index, now)
        self._progress.forget(index)

    def silent(self, starting: list[CoreProcess], now: float) -> list[tuple[CoreProcess, float]]:
        """(core, seconds of silence) of each of ``starting`` (the cores not ready yet,
        their processes alive) that neither sent a heartbeat nor ran for longer than the
        timeout as of ``now``."""
        for core in starting:
            if core.pid is not None and self._progress.ran(core.index, core.pid):
                self._monitor.beat(core.index, now)
        by_index = {core.index: core for core in starting}
        return [(by_index[i], s) for i, s in self._monitor.silent_ranks(now) if i in by_index]
