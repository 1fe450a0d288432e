"""How many CPU threads the engine may use, and which CPUs, as the OS grants them.

A process may run on the CPUs of its affinity mask (``taskset``, ``docker --cpuset-cpus``) and,
in a container, for at most a CPU quota per scheduling period (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; ``docker --cpus``). OpenMP (and so torch) counts
only the mask: a 2-CPU quota on a 64-core host would otherwise start 64 threads that the kernel
throttles in turn, each parallel region then waiting for its slowest, throttled thread.

Pure reading of the OS, no threads started: it sits with the configuration so that
``EngineConfig`` can refuse a ``cpu_threads`` (and ``SpeculativeConfig`` a ``draft_cpu_threads``)
above these CPUs (:func:`check_thread_limit`), and a ``cpu_threads_bind`` CPU outside the mask
(:func:`check_bind_cpus`), before anything loads; :mod:`kvflow.kernels.cpu_threads` sizes and
pins the threads, with the same checks where the engine starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus() -> list[int]:
    """The CPU ids of this process's affinity mask, ascending (all online CPUs where the OS has
    no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def own_cgroup_dirs(root: Path, proc_cgroup: str, controller: str = "cpu") -> list[Path]:
    """The cgroup folders of this process and of its ancestors, deepest first, for the v2
    hierarchy (``0::/path``) and the v1 ``controller`` (``N:cpu,cpuacct:/path``,
    ``N:memory:/path``), from ``proc_cgroup`` (the text of ``/proc/self/cgroup``)."""
    mounts = (("cpu,cpuacct", "cpu") if controller == "cpu" else (controller,))
    dirs: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        names = controllers.split(",")
        if controllers == "":
            base = root
        elif controller in names:
            base = next((root / n for n in (controllers, *mounts)
                         if (root / n).is_dir()), root / controller)
        else:
            continue
        here = base / rel.lstrip("/")
        while True:
            dirs.append(here)
            if here == base:
                break
            here = here.parent
    return dirs


def _quota_in(folder: Path) -> float | None:
    """CPUs' worth of quota set in one cgroup folder (v2 ``cpu.max`` or v1 CFS files), or
    None when it sets none or cannot be read."""
    try:
        text = (folder / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) of this process's cgroup and its ancestors,
    or None when none is set (or there is no cgroup file system)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas = [q for d in own_cgroup_dirs(root, proc_cgroup) if (q := _quota_in(d)) is not None]
    return min(quotas) if quotas else None


def default_num_threads(current: int, cpus: int, quota: float | None) -> int:
    """Threads to use when the user chose none: ``current`` (torch's count, which honours
    ``OMP_NUM_THREADS`` and the affinity mask) capped by the usable CPUs and by the cgroup
    quota rounded down (a thread that would get only part of a CPU stalls every parallel
    region it joins). At least 1."""
    cap = cpus if quota is None else min(cpus, math.floor(quota + 1e-6))
    return max(1, min(current, cap))


def granted_cpus(allowed: list[int], quota: float | None) -> int:
    """CPUs a process with affinity mask ``allowed`` and cgroup CPU ``quota`` (CPUs, None:
    none) may keep busy at once: the mask's size, capped by the quota rounded up (a 1.5-CPU
    quota runs 2 threads, each part of the time). At least 1 for a non-empty mask."""
    return len(allowed) if quota is None else min(len(allowed), math.ceil(quota))


def check_thread_limit(cpu_threads: int, allowed: list[int], quota: float | None,
                       name: str = "cpu_threads",
                       default: str = "torch's count capped by these CPUs") -> None:
    """Refuse ``cpu_threads`` (the option ``name``: ``--cpu-threads``, the threads of one worker
    process, or ``speculative_config draft_cpu_threads``, the draft model's) above
    :func:`granted_cpus` of the affinity mask ``allowed`` and the cgroup ``quota`` (CPUs);
    ``default`` says what leaving the option out gives. Threads beyond the CPUs only wait for
    each other at every parallel region (a user's ``--cpu-threads 999`` was reported to take
    67 s to start; it only warned then).

    Raises:
        ValueError: naming ``name``, its value, the limit and where the limit comes from.
    """
    granted = granted_cpus(allowed, quota)
    if cpu_threads <= granted:
        return
    source = f"its affinity mask has {len(allowed)} CPUs"
    if quota is not None:
        source += f", its cgroup CPU quota is {quota:g} CPUs"
    raise ValueError(f"{name}={cpu_threads} exceeds the {granted} CPUs this process may "
                     f"use ({source}): threads beyond the CPUs only wait for each other at "
                     f"every parallel step; give at most {granted}, or leave it out (the "
                     f"default is {default})")


def check_bind_cpus(bind: str, cpus: list[int], allowed: list[int]) -> None:
    """Refuse a ``cpu_threads_bind`` list ``bind`` whose CPUs ``cpus`` (ids; one worker's part
    where the engine starts, all parts together in ``EngineConfig``) include any outside the
    affinity mask ``allowed``: a thread cannot be pinned there.

    Raises:
        ValueError: naming ``cpu_threads_bind``, the CPUs outside the mask and the mask
            (:func:`cpus_text`).
    """
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"cpu_threads_bind={bind!r} names CPUs {cpus_text(outside)} outside "
                         f"this process's affinity mask {cpus_text(allowed)}")


def cpus_text(cpus: list[int]) -> str:
    """A CPU list for a message: as a Python list up to 16 CPUs (``[2, 5]``), else as runs
    with the count (``[0-3, 8-65535] (65532 CPUs)``), so a typo such as ``0-65535`` is not
    one line of 65,536 numbers."""
    if len(cpus) <= 16:
        return str(cpus)
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    text = ", ".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)
    return f"[{text}] ({len(cpus)} CPUs)"
