"""How much host memory this process may still take, as the OS grants it.

Linux's ``MemAvailable`` (free pages plus the page cache the kernel can reclaim) is the
machine's; in a container the memory cgroup's limit may be far lower (``docker --memory``,
a Kubernetes pod's limit), and the process is killed past it whatever the machine has left.
The headroom of a cgroup folder is its limit minus its usage plus its reclaimable file cache
(v2: ``memory.max`` - ``memory.current`` + ``inactive_file`` of ``memory.stat``; v1:
``memory.limit_in_bytes`` - ``memory.usage_in_bytes`` + ``total_inactive_file``), as
``docker stats`` counts usage; the tightest folder of the process and its ancestors counts.

Pure reading of the OS, as :mod:`kvflow.config.cpu_limits`.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.config.cpu_limits import CGROUP_ROOT, own_cgroup_dirs
from kvflow.platforms.cpu import MEMINFO, host_memory_bytes, mem_available

# v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit
_NO_LIMIT = 2**62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 "max": no limit


def _inactive_file(folder: Path) -> int:
    """Reclaimable file cache charged to the folder (0 when ``memory.stat`` is unreadable)."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    stats = dict(line.split(" ", 1) for line in lines if " " in line)
    value = stats.get("total_inactive_file", stats.get("inactive_file", "0")).strip()
    return int(value) if value.isdigit() else 0


def _headroom_in(folder: Path) -> int | None:
    """Bytes the folder's memory limit still leaves (None: no limit set, or unreadable)."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            return max(0, limit - usage + _inactive_file(folder))
    return None


def cgroup_memory_headroom(root: Path = CGROUP_ROOT,
                           proc_cgroup: str | None = None) -> int | None:
    """The tightest memory headroom (bytes) of this process's cgroup and its ancestors, or
    None when none sets a limit (or there is no cgroup file system). ``proc_cgroup``: the text
    of ``/proc/self/cgroup`` (read when None)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    rooms = [r for d in own_cgroup_dirs(root, proc_cgroup, "memory")
             if (r := _headroom_in(d)) is not None]
    return min(rooms) if rooms else None


def host_memory_available(meminfo: str = MEMINFO, root: Path = CGROUP_ROOT,
                          proc_cgroup: str | None = None) -> tuple[int, str]:
    """(bytes this process may still allocate, where that number comes from): the lower of
    ``MemAvailable`` (all physical memory where ``meminfo`` has none) and the memory cgroup's
    headroom."""
    avail = mem_available(meminfo)
    found = (host_memory_bytes(), "physical memory") if avail is None \
        else (avail, "MemAvailable in /proc/meminfo")
    room = cgroup_memory_headroom(root, proc_cgroup)
    if room is not None and room < found[0]:
        return room, "the memory cgroup's limit less its usage"
    return found
