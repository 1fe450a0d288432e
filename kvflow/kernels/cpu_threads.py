"""Choosing and pinning the CPU compute threads of an engine (``--cpu-threads``,
``--cpu-threads-bind``).

torch's intra-op threads and kvflow's native kernels share one OpenMP pool
(:mod:`kvflow.kernels.cpu_native`), so one ``torch.set_num_threads`` sizes both. The default
keeps torch's count (which honours ``OMP_NUM_THREADS`` and the affinity mask) but never exceeds
the CPUs the affinity mask grants or the cgroup CPU quota (:mod:`kvflow.config.cpu_limits`).
Pinning thread i to CPU i of a list keeps each thread on its core's caches and keeps two of
the engine's threads off one core beside a busy process. vLLM pins every thread by default;
kvflow, when its threads fill the CPUs, pins the OpenMP workers for good and the calling
thread only while it runs a model step (:class:`CallerPin`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvflow.config import parse_cpu_list
from kvflow.config.cpu_isa import forced_isa_level
from kvflow.config.cpu_limits import (
    cgroup_cpu_limit,
    check_bind_cpus,
    check_thread_limit,
    cpus_text,
    default_num_threads,
    granted_cpus,
    usable_cpus,
)
from kvflow.kernels.cpu_native import NativeCpuKernels, native_cpu_kernels
from kvflow.kernels.cpu_pool import CpuPool
from kvflow.platforms.cpu_contention import GovernorSettings, ThreadGovernor, runqueue_wait_ns

logger = logging.getLogger(__name__)


def resolve_threads(cpu_threads: int | None, bind: str | None, allowed: list[int],
                    quota: float | None, current: int, rank: int = 0, ranks: int = 1,
                    pin_by_default: bool = True) -> tuple[int, list[int] | None]:
    """(threads, CPUs to pin them to or None) of rank ``rank`` of ``ranks`` worker processes
    on this machine, for the engine's ``cpu_threads`` / ``cpu_threads_bind``, given the
    affinity mask ``allowed``, the cgroup ``quota`` (CPUs) and torch's ``current`` count.

    The ranks share the CPUs: by default each gets ``1 / ranks`` of them (and of the quota),
    ``auto`` pins rank r to the r-th slice of ``allowed``, and an explicit list gives one part
    per rank separated by ``|`` (``0-3|4-7``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` form);
    ``none`` pins nothing.

    Left unset (``bind`` None) with ``pin_by_default``, when the threads fill the rank's CPUs
    they are pinned as with ``auto`` (:func:`configure_cpu_threads` then pins the calling
    thread only while it runs the model, :class:`CallerPin`). Beside a busy process on 2 CPUs
    that kept a median 60% of the quiet throughput against 49% unpinned (docs/benchmarks.md,
    "session 8").

    Raises:
        ValueError: when ``bind`` names a CPU outside ``allowed``
            (:func:`~kvflow.config.cpu_limits.check_bind_cpus`), has not one ``|`` part per
            rank or gives a CPU to two ranks, or ``auto`` pinning is asked for more threads
            than the rank's CPUs.
    """
    share = allowed[rank * len(allowed) // ranks:(rank + 1) * len(allowed) // ranks] or \
        allowed[rank % len(allowed):][:1]
    share_quota = None if quota is None else quota / ranks
    if bind in (None, "auto", "none"):
        threads = cpu_threads or default_num_threads(current, len(share), share_quota)
        return threads, _share_pinning(threads, bind, share, pin_by_default, rank, allowed)
    cpus = _bound_cpus(bind, rank, ranks, allowed)
    return len(cpus), cpus


def _share_pinning(threads: int, bind: str | None, share: list[int], pin_by_default: bool,
                   rank: int, allowed: list[int]) -> list[int] | None:
    """The CPUs of ``share`` (the rank's slice of ``allowed``) its ``threads`` are pinned
    to, or None: nothing for ``none`` (or unset without ``pin_by_default``), the whole
    share when unset and the threads fill it, one CPU per thread for ``auto``.

    Raises:
        ValueError: for ``auto`` with more threads than the share's CPUs.
    """
    if bind == "none" or (bind is None and not pin_by_default):
        return None
    if bind is None:
        return share if 1 < threads == len(share) else None
    if threads > len(share):
        raise ValueError(f"cpu_threads={threads} cannot be pinned to the {len(share)} "
                         f"CPUs {share} of rank {rank} (affinity mask {allowed}): "
                         f"cpu_threads_bind='auto' pins one thread per CPU; give at most "
                         f"{len(share)} threads, or cpu_threads_bind='none'")
    return share[:threads]


def _bound_cpus(bind: str, rank: int, ranks: int, allowed: list[int]) -> list[int]:
    """Rank ``rank``'s part of an explicit ``cpu_threads_bind`` list (``0-3|4-7``: one
    ``|``-separated part per rank).

    Raises:
        ValueError: for a part count other than ``ranks``, a CPU given to two ranks, or a CPU
            outside ``allowed``.
    """
    parts = bind.split("|")
    if len(parts) != ranks:
        raise ValueError(f"cpu_threads_bind={bind!r} has {len(parts)} '|'-separated parts "
                         f"for {ranks} worker processes; give one per rank")
    lists = [parse_cpu_list(part) for part in parts]
    others = {c for r, cs in enumerate(lists) if r != rank for c in cs}
    shared = sorted(others & set(lists[rank]))
    if shared:
        raise ValueError(f"cpu_threads_bind={bind!r} gives CPUs {cpus_text(shared)} to more "
                         "than one worker process; give each rank CPUs of its own")
    cpus = lists[rank]
    check_bind_cpus(bind, cpus, allowed)
    return cpus


def check_cpu_threads(cpu_threads: int | None, bind: str | None, ranks: int,
                      warn: bool = True) -> None:
    """Check ``--cpu-threads`` / ``--cpu-threads-bind`` for every one of ``ranks`` worker
    processes on this machine before any starts (each worker resolves its own share later
    with :func:`resolve_threads`), so a bad list is one error in the calling process rather
    than a failed worker. ``EngineConfig`` refuses a count above the CPUs and a list CPU
    outside the affinity mask already; this checks both again (the same functions,
    :mod:`kvflow.config.cpu_limits`) where the engine runs, for engines built without one.
    Warns (when ``warn``: one data-parallel replica's engine core of several) when the
    ranks' threads together exceed those CPUs.

    Raises:
        ValueError: see :func:`resolve_threads` and
            :func:`~kvflow.config.cpu_limits.check_thread_limit`.
    """
    allowed, quota = usable_cpus(), cgroup_cpu_limit()
    if cpu_threads is not None:
        check_thread_limit(cpu_threads, allowed, quota)
    for rank in range(ranks):
        resolve_threads(cpu_threads, bind, allowed, quota, torch.get_num_threads(), rank, ranks)
    granted = granted_cpus(allowed, quota)
    if warn and cpu_threads is not None and cpu_threads * ranks > granted:
        logger.warning("cpu_threads=%d for each of %d worker process(es) exceeds the %d CPUs "
                       "this process may use (affinity mask %s, CPU quota %s): threads will "
                       "wait for each other", cpu_threads, ranks, granted, allowed, quota)


class CallerPin:
    """Pins the calling thread to ``cpu`` while a ``with`` block runs and gives it its own
    affinity mask back after (``cpu`` None: does nothing). The engine's default pinning runs
    each model step inside one: the OpenMP workers stay pinned, and the thread that runs the
    model - in ``LLM`` the user's own thread, whose mask every thread or process it starts
    inherits - is pinned only while it computes. Costs two ``sched_setaffinity`` calls
    (microseconds) per block. Not reentrant."""

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self._saved: set[int] | None = None

    def __enter__(self) -> None:
        if self.cpu is not None:
            self._saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, (self.cpu,))

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            os.sched_setaffinity(0, self._saved)
            self._saved = None


def configure_cpu_threads(cpu_threads: int | None, bind: str | None, rank: int = 0,
                          ranks: int = 1, gemm_pool: bool = False, pin_by_default: bool = True
                          ) -> tuple[int, list[int] | None, CallerPin]:
    """Size (and pin, see :func:`resolve_threads`) the CPU compute threads of worker ``rank``
    of ``ranks`` on this machine; call from the thread that runs the model. Returns (threads,
    pinned CPUs or None, the :class:`CallerPin` to run each model step in). An asked-for
    pinning (``bind``) pins the calling thread for good; the default one pins the OpenMP
    workers for good and the calling thread through the returned CallerPin. With
    ``gemm_pool`` (and the native kernels), kvflow's C GEMM shares its work through a
    :class:`~kvflow.kernels.cpu_pool.CpuPool` of ``threads - 1`` workers (pinned to the CPUs
    after the caller's when pinning), :func:`use_gemm_pool`.

    Without the native kernels, an asked-for pinning restricts the whole process to the listed
    CPUs instead (the threads may still move among them), with a warning; the default one is
    then left out.

    Raises:
        ValueError: see :func:`resolve_threads`.
    """
    threads, cpus = resolve_threads(cpu_threads, bind, usable_cpus(), cgroup_cpu_limit(),
                                    torch.get_num_threads(), rank, ranks, pin_by_default)
    torch.set_num_threads(threads)
    kernels = native_cpu_kernels()
    caller = CallerPin(None)
    if cpus is not None and bind is None:  # the default: workers now, the caller per step
        if kernels is None:
            cpus = None
        elif kernels.bind_threads([None, *cpus[1:]]):
            caller = CallerPin(cpus[0])
        else:
            logger.warning("could not pin the CPU worker threads to %s", cpus[1:])
            cpus = None
    elif cpus is not None:
        if kernels is not None:
            if not kernels.bind_threads(cpus):
                logger.warning("could not pin every CPU thread to %s", cpus)
        else:
            logger.warning("native CPU kernels unavailable: the process is restricted to CPUs "
                           "%s, its threads not pinned one by one", cpus)
            os.sched_setaffinity(0, cpus)
    use_gemm_pool(kernels, threads, cpus, gemm_pool)
    logger.info("CPU compute threads: %d%s%s; %s", threads, f", pinned to {cpus}" if cpus else "",
                ", GEMM work shared by kvflow's pool"
                if gemm_pool and threads > 1 and kernels is not None else "",
                native_kernels_note(kernels))
    return threads, cpus, caller


def native_kernels_note(kernels: NativeCpuKernels | None) -> str:
    """The start-up line's word on kvflow's native CPU kernels: the ISA level of the library
    loaded (the best this CPU runs, or the one ``KVFLOW_CPU_ISA`` forced), or that torch's
    kernels run (``KVFLOW_NATIVE_CPU=0`` or a failed build)."""
    if kernels is None:
        return "native CPU kernels off (torch's kernels run)"
    how = "forced by KVFLOW_CPU_ISA" if forced_isa_level() else "the best this CPU runs"
    return f"native CPU kernels: {kernels.isa} ({how})"


def use_gemm_pool(kernels: NativeCpuKernels | None, threads: int, cpus: list[int] | None,
                  enabled: bool = True) -> None:
    """Give ``kernels`` (the process's native kernels; None: nothing to do) a pool of
    ``threads - 1`` workers (pinned to ``cpus[1:]`` when ``cpus`` is given) for their GEMM and
    attention, keeping the current pool when it matches; disabled or with one thread, the
    kernels' pool is removed. The pool is process-wide, like torch's thread count."""
    if kernels is None:
        return
    if not enabled or threads < 2:
        kernels.pool = None
        return
    workers = None if cpus is None else cpus[1:threads]
    current = kernels.pool
    if current is not None and current.num_workers == threads - 1 and current.cpus == workers:
        return
    kernels.pool = CpuPool(kernels, threads - 1, workers)


@contextmanager
def cpu_thread_count(cpu_threads: int | None) -> Iterator[int]:
    """Run the block with the thread count a single-process engine would use
    (:func:`resolve_threads`, no pinning), restoring torch's count after; yields it."""
    before = torch.get_num_threads()
    threads, _ = resolve_threads(cpu_threads, None, usable_cpus(), cgroup_cpu_limit(), before,
                                 pin_by_default=False)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


class AdaptiveThreads:
    """Lowers the compute thread count while other processes take this process's CPUs, and
    raises it again when they leave (``--cpu-adaptive-threads``; the policy and the signal are
    :class:`kvflow.platforms.cpu_contention.ThreadGovernor`'s). Call :meth:`before_step` from
    the thread that runs the model, between steps (``torch.set_num_threads`` sets that
    thread's OpenMP team size, which the native kernels read per call).

    Args:
        threads: the configured count, the most it uses.
        settings: the governor's tuning.
        clock: monotonic seconds (injectable for tests).
        read_wait: the process's cumulative runqueue wait in ns, or None where unknown.
    """

    def __init__(self, threads: int, settings: GovernorSettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 read_wait: Callable[[], int | None] = runqueue_wait_ns) -> None:
        self.governor = ThreadGovernor(threads, settings)
        self.clock, self.read_wait = clock, read_wait
        self._reported = False

    @classmethod
    def create(cls, enabled: bool, threads: int, pinned: bool, ranks: int,
               warn: bool = True) -> AdaptiveThreads | None:
        """The governor an engine uses, or None: off when disabled, with one thread, with pinned
        threads (fewer threads would leave their CPUs idle while the rest share a busy one),
        with several worker ranks (which run in lock-step), or where the kernel gives no
        scheduler statistics (each of these logged as a warning when ``enabled`` and ``warn``:
        an engine's other ranks pass False, so the engine logs it once)."""
        if not enabled:
            return None
        why = ("one thread" if threads < 2 else "pinned threads" if pinned else
               f"{ranks} worker processes" if ranks > 1 else
               "no scheduler statistics (/proc/self/schedstat)" if runqueue_wait_ns() is None
               else None)
        if why is not None:
            if warn:
                logger.warning("--cpu-adaptive-threads is off: not available with %s", why)
            return None
        return cls(threads)

    @property
    def threads(self) -> int:
        """The thread count in force."""
        return self.governor.threads

    def before_step(self) -> None:
        """Close a measurement window when one is due and apply the governor's choice."""
        now = self.clock()
        if not self.governor.due(now):
            return
        wait = self.read_wait()
        if wait is None:
            return
        before = self.governor.threads
        threads = self.governor.observe(now, wait)
        if threads is None:
            return
        torch.set_num_threads(threads)
        level = logging.DEBUG if self._reported else logging.INFO
        self._reported = True
        logger.log(level, "CPU compute threads %d -> %d (%s)", before, threads,
                   "other processes are taking the CPUs: runqueue wait above "
                   f"{self.governor.settings.high:.0%}" if threads < before else "probe")
