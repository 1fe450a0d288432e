"""Noticing that other processes take this process's CPUs, and choosing a thread count for it.

A parallel region of N OpenMP threads ends at a barrier: it lasts as long as its slowest
thread. When another busy process shares the cores, the OS deschedules one of the engine's
threads for a whole time slice (milliseconds) now and then, and every region that thread is
part of waits for it; an engine step runs hundreds of short regions. On 2 cores beside one
busy-looping process, 2 threads kept 42% of their quiet throughput, while 1 thread runs on the
core the neighbour leaves (issue 23; docs/benchmarks.md).

The signal is the kernel's scheduler statistics: ``/proc/<pid>/task/<tid>/schedstat`` holds,
per thread, the nanoseconds it ran and the nanoseconds it spent *runnable but waiting* for a
CPU (``Documentation/scheduler/sched-stats.rst``). On a machine with a free core per thread
that wait is near zero; beside a busy neighbour each of the engine's threads waits for a share
of the time. :class:`ThreadGovernor` turns windows of that wait into a thread count: fewer
threads while the wait is high, and back to all of them when a probe finds it low again.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

TASK_DIR = "/proc/self/task"


def runqueue_wait_ns(task_dir: str = TASK_DIR) -> int | None:
    """Nanoseconds the threads of this process (the tasks under ``task_dir``) have spent
    runnable but waiting for a CPU since they started, summed; None where the kernel gives no
    ``schedstat`` (not Linux, or built without scheduler statistics). Threads that exit between
    the listing and the read are skipped."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    total, seen = 0, False
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:
            continue
        if len(fields) >= 2:
            total += int(fields[1])
            seen = True
    return total if seen else None


@dataclass
class GovernorSettings:
    """Tuning of :class:`ThreadGovernor`.

    Attributes:
        window_s: seconds of wall time per measurement window.
        high: wait fraction (runqueue wait / (wall time x threads)) above which a window counts
            as contended.
        strikes: contended windows in a row before the thread count drops.
        probe_s: seconds at the reduced count before the first probe at the full count; doubled
            after each probe that finds contention, up to ``max_probe_s``, reset after one that
            does not.
        max_probe_s: the longest wait between probes.
    """

    window_s: float = 0.2
    high: float = 0.15
    strikes: int = 2
    probe_s: float = 1.0
    max_probe_s: float = 16.0


class ThreadGovernor:
    """Chooses the engine's compute thread count from windows of runqueue wait.

    Feed it (time, cumulative wait) after every step with :meth:`observe`; it returns a new
    thread count when one should change, else None. ``strikes`` contended windows in a row
    drop the count by the cores the wait says were lost (at least one, never below one); after
    ``probe_s`` at a reduced count it probes the full count for one window and stays there if
    that window is not contended, else goes back and probes again later (exponential
    back-off).

    Args:
        max_threads: the configured thread count (``--cpu-threads`` or the default).
        settings: tuning (defaults: :class:`GovernorSettings`).
    """

    def __init__(self, max_threads: int, settings: GovernorSettings | None = None) -> None:
        self.max_threads = self.threads = max_threads
        self.settings = settings or GovernorSettings()
        self.probe_s = self.settings.probe_s
        self._start: tuple[float, int] | None = None
        self._strikes = 0
        self._next_probe: float | None = None  # set while reduced
        self._probing = False
        self.switches = 0  # thread-count changes so far
        self.reduced_s = 0.0  # seconds of closed windows run below max_threads

    def due(self, now: float) -> bool:
        """Whether :meth:`observe` at ``now`` would close a window (so the caller reads the
        wait only then)."""
        return self._start is None or now - self._start[0] >= self.settings.window_s

    def observe(self, now: float, wait_ns: int) -> int | None:
        """Account the window up to ``now`` (seconds, monotonic) with the process's cumulative
        runqueue wait ``wait_ns``; return the thread count to switch to, or None to keep
        :attr:`threads`."""
        if self._start is None:
            self._start = (now, wait_ns)
            return None
        t0, w0 = self._start
        if now - t0 < self.settings.window_s:
            return None
        self._start = (now, wait_ns)
        if self.threads < self.max_threads:
            self.reduced_s += now - t0
        frac = (wait_ns - w0) / 1e9 / ((now - t0) * self.threads)
        return self._decide(now, frac)

    def _decide(self, now: float, frac: float) -> int | None:
        contended = frac > self.settings.high
        if self._probing:
            self._probing = False
            if contended:
                self.probe_s = min(2 * self.probe_s, self.settings.max_probe_s)
                return self._switch(now, self._reduced(frac))
            self.probe_s, self._next_probe = self.settings.probe_s, None
            return None
        if self._next_probe is not None and now >= self._next_probe:
            self._probing = True
            return self._switch(now, self.max_threads)
        self._strikes = self._strikes + 1 if contended and self.threads > 1 else 0
        if self._strikes >= self.settings.strikes:
            return self._switch(now, self._reduced(frac))
        return None

    def _reduced(self, frac: float) -> int:
        """The count after a contended window at :attr:`threads`: minus the cores lost."""
        lost = max(1, math.floor(frac * self.threads + 0.5))
        return max(1, self.threads - lost)

    def _switch(self, now: float, threads: int) -> int | None:
        self._strikes = 0
        if threads < self.max_threads and not self._probing:
            self._next_probe = now + self.probe_s
        if threads == self.threads:
            return None
        self.threads = threads
        self.switches += 1
        return threads
