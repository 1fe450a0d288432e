"""Engine cores forked from Python's forkserver: what such a core takes from the process that
asked for it, and when that forkserver may no longer be used.

``multiprocessing``'s forkserver is one process per API process, started as a new interpreter at
the first ``Process.start`` of the ``forkserver`` context; it imports :data:`PRELOAD` (torch,
transformers, the engine: the 2.5-3 s of CPU a spawned core pays each time) and then forks one
child per ``Process.start``. It computes nothing: it imports and waits on its Unix socket, so
no OpenMP region has run and no CUDA context exists when it forks (the import fills none of
kvflow's per-process caches either: tests/test_core_start_method.py). The forkserver and its
preload setting are ``multiprocessing``'s own state, not kvflow's.

A forkserver child differs from a spawned one in what the forkserver had when it started:

* its environment, not the parent's of now. :class:`ParentState` carries the parent's
  current environment (:func:`current_environment`: what a spawned child would get) with the
  child's arguments, and :meth:`ParentState.apply` replaces the inherited one first thing.
  That is enough for what is read when the engine runs: every ``KVFLOW_*`` variable (none
  is read at import, and no cache kvflow fills from one is filled at import), pytest's
  ``PYTEST_*``, and :data:`LIBRARY_SET` (set by libraries imported after the forkserver
  started). What torch, transformers, glibc or the OpenMP runtime read when the forkserver
  started (``OMP_*``, ``MALLOC_*``, ``HF_*`` folders, ``LD_PRELOAD``, ...) cannot be read
  again, so :func:`forkserver_usable` is false when any other variable differs from the
  forkserver's start environment, and the core is spawned (``tests/e2e/zygote.py`` applies
  the same rule to the servers it forks).
* its standard output and error: the forkserver's (under pytest, the capture file of whichever
  test started it). :class:`ParentState` passes the parent's current fds 1 and 2 (sent to the
  forkserver over its socket, as ``multiprocessing`` sends a ``Connection``) and the child puts
  them in place.
* its parent process: the forkserver. ``multiprocessing.parent_process()`` is still the API
  process (read from a pipe it holds), which is what the core's start gate and idle check use.

``sys.path``, the working directory and ``sys.argv`` travel in ``multiprocessing``'s
preparation data, as for a spawned child.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
from collections.abc import Mapping
from multiprocessing import context, reduction
from multiprocessing import forkserver as mp_forkserver
from typing import Any

logger = logging.getLogger(__name__)

# what the forkserver imports before it forks its first core (an engine core's imports)
PRELOAD = ("kvflow.engine.core_proc", "transformers.activations")
# variables read when kvflow runs, never at import: a forkserver started with other values serves
RUN_TIME_PREFIXES = ("KVFLOW_", "PYTEST_")
# variables libraries set in this process when imported, harmless to a forkserver started
# without them (its child gets them with the rest of the environment): the terminal size GNU
# readline exports (read when asked: shutil.get_terminal_size), and scikit-learn's settings for
# Intel's OpenMP runtime (torch's Linux wheels load GNU's; Intel's would read them when it
# loads, and its default for the one that matters at a fork, KMP_INIT_AT_FORK, is the safe one)
LIBRARY_SET = ("COLUMNS", "LINES", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


def import_time_differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The names of the variables whose values differ between the environments ``a`` and ``b``
    (set in one only counts), but for ``KVFLOW_*``, ``PYTEST_*`` and :data:`LIBRARY_SET`;
    empty when none does."""
    names = set(a) | set(b)
    return sorted(k for k in names if not k.startswith(RUN_TIME_PREFIXES)
                  and k not in LIBRARY_SET and a.get(k) != b.get(k))


def current_environment() -> dict[str, str]:
    """The environment a process started now gets: the C library's ``environ``, which ``exec``
    passes on (spawned cores and the forkserver get it). A library that calls ``setenv`` itself
    changes it behind ``os.environ``'s back: GNU readline, once imported (pytest's debugger
    imports it), sets ``COLUMNS`` and ``LINES``. ``os.environ`` where ``environ`` cannot be
    read (no such symbol)."""
    try:
        entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, AttributeError):
        return dict(os.environ)
    env, i = {}, 0
    while entries[i] is not None:
        name, _, value = entries[i].partition(b"=")
        env[os.fsdecode(name)] = os.fsdecode(value)
        i += 1
    return env


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, None while none was started (``multiprocessing``
    keeps it in a private attribute: None too where a Python version names it otherwise)."""
    return getattr(getattr(mp_forkserver, "_forkserver", None), "_forkserver_pid", None)


def process_environment(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``: what it got
    at ``exec``, which is what it read at import), None where it cannot be read (another OS,
    the process is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {os.fsdecode(k): os.fsdecode(v) for k, v in pairs} or None  # a zombie reads empty


def forkserver_usable(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an engine core may be forked from this process's forkserver now: the platform
    has one, and either none runs yet (the next start runs one with the current environment) or
    the running one started with the same environment as ``environ`` (default:
    :func:`current_environment`, what a spawned core would get) but for ``KVFLOW_*`` and
    ``PYTEST_*`` (module docstring). False where that environment cannot be read."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    pid = forkserver_pid()
    if pid is None:
        return True
    started = process_environment(pid)
    environ = current_environment() if environ is None else environ
    differ = ["(unreadable)"] if started is None else import_time_differences(environ,
                                                                                   started)
    if differ:
        logger.info("engine core spawned (a new interpreter, its imports again), not forked "
                    "from the forkserver: %s changed since the forkserver started (read at "
                    "import)", ", ".join(differ[:5]))
    return not differ


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class ParentState:
    """What a forkserver child takes from the process that started it: that process's
    environment (a copy of ``environ`` when made: :func:`current_environment`, as a spawned
    child would get it) and, once unpickled in the child, its standard output and error.

    Pickle it only as an argument of a ``forkserver`` (or ``spawn``) ``Process``: its fds
    travel with the process (``multiprocessing.reduction.DupFd``).

    Raises:
        TypeError: when pickled outside ``Process.start``.
    """

    def __init__(self, environ: Mapping[str, str], stdio: tuple[Any, Any] = (None, None)) -> None:
        self.environ = dict(environ)
        self._stdio = stdio  # in the child: what detaches into the parent's fds 1 and 2

    def __reduce__(self) -> tuple[Any, ...]:
        if context.get_spawning_popen() is None:
            raise TypeError("ParentState is pickled only by multiprocessing's Process.start")
        stdio = tuple(reduction.DupFd(fd) if _open(fd) else None for fd in (1, 2))
        return (ParentState, (self.environ, stdio))

    def apply(self) -> None:
        """In the child, first thing: make ``os.environ`` the parent's (variables it lacks
        removed) and point fds 1 and 2 where the parent's pointed."""
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        os.environ.update(self.environ)
        for target, dup in zip((1, 2), self._stdio, strict=True):
            if dup is None:
                continue
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


__all__ = ["LIBRARY_SET", "PRELOAD", "RUN_TIME_PREFIXES", "ParentState", "current_environment",
           "forkserver_pid", "forkserver_usable", "import_time_differences",
           "process_environment"]
