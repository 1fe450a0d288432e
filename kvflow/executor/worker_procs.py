"""The multiprocess executor's worker processes from the outside: how one ended
(:func:`describe_exit`) and their teardown (wait, kill and reap them, close the executor's
sockets, remove its private directory), also run by the executor's finalizer."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time

import zmq


def describe_exit(code: int) -> str:
    """'exit code 3' or 'killed by signal SIGKILL' for a process's return code."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def wait_or_kill(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Give ``procs`` ``grace_s`` seconds to exit, then SIGKILL and reap the rest."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    kill_all(procs, None)


def release_all(procs: list[subprocess.Popen], folder: str, ctx: zmq.Context,
                sockets: list[zmq.Socket]) -> None:
    """Close ``sockets`` without lingering and end ``ctx``, then :func:`kill_all`."""
    for sock in sockets:
        sock.close(linger=0)
    if not ctx.closed:
        ctx.term()
    kill_all(procs, folder)


def kill_all(procs: list[subprocess.Popen], folder: str | None) -> None:
    """SIGKILL and reap every process still running; remove ``folder``."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
