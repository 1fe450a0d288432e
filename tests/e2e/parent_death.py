"""A child process that ends with its parent: Linux's ``prctl(PR_SET_PDEATHSIG)``.

A test server is a process of its own; when the test process is SIGKILLed (a CI time-out, an
interrupted run) nothing tells the server to stop, and it used to run on, holding its port, its
memory and a core. With a parent-death signal the kernel sends it SIGTERM (a server's clean
shutdown: it stops its engine core) as soon as its parent is gone.

Limit: Linux sends the signal when the *thread* that forked the child ends, not the process;
so fork from a thread that lives as long as the process does (pytest's main thread: fixtures
run there), never from a short-lived worker thread, whose end would stop the server at once.
Elsewhere than Linux both functions change nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a freshly forked child: have the kernel send ``sig`` when the thread that forked it
    ends; if ``parent`` (the pid that forked it) is already gone, the signal the kernel could
    no longer send is sent now (the parent died between the fork and this call). Linux only;
    elsewhere a no-op. Errors of ``prctl`` are ignored (no signal is set up)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def with_parent_death(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """The command line to pass ``subprocess.Popen`` instead of ``argv``: a short Python
    launcher (:data:`_LAUNCHER`) that asks for ``sig`` at its parent's death
    (:func:`die_with_parent`, with this process's pid), then ``execv``s ``argv`` (``argv[0]`` a
    path: ``sys.executable``), which keeps the signal (Linux keeps it across ``execve``). Same
    pid, same final command line; about 30 ms more start-up. A launcher rather than Popen's
    ``preexec_fn``, which is unsafe in a process with threads (a test process often has some).
    Call it on the thread that calls ``Popen``, a long-lived one. ``argv`` itself off Linux.
    """
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), str(int(sig)), *argv]


# argv: parent pid, signal number, then the program and its arguments
_LAUNCHER = f"""
import ctypes, os, sys
parent, sig = int(sys.argv[1]), int(sys.argv[2])
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, sig)
if os.getppid() != parent:
    os.kill(os.getpid(), sig)
os.execv(sys.argv[3], sys.argv[3:])
"""
