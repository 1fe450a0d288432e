"""Daemon threads that the interpreter's exit stops and waits for.

A daemon thread still running when the interpreter finalizes is ended by it: the thread's next
attempt to take the GIL calls ``pthread_exit``, which unwinds the thread's stack. Inside a
C++ extension that re-takes the GIL in a destructor (torch's and tvm-ffi's "release the GIL
around this call" guards, noexcept) that unwinding ends in ``std::terminate``: ``terminate
called without an active exception`` and exit status 134 (SIGABRT) instead of the script's own.
Measured: the KV prefault thread inside a torch copy (``kvflow/platforms/cpu_memory.py``), a
grammar compile inside xgrammar (``kvflow/structured/compile_pool.py``, every one of 6 runs
whose compile ended while the interpreter finalized). A thread that may be inside such a call
at exit is an :class:`ExitJoinedThread`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_QUIET_S = 1.0  # how long the exit waits for a thread before it says so in the log


class ExitJoinedThread(threading.Thread):
    """A daemon thread running ``target(*args)`` that an ``atexit`` hook stops and joins: the
    hook sets ``stop`` (the target's to watch, where its work can stop between two calls) and
    waits up to ``exit_timeout_s`` seconds for the thread to end (None: until it ends, saying
    so in the log after a second); a Ctrl-C ends the wait. The hook is registered by
    :meth:`start` and dropped when the thread ends, so a thread that ended holds nothing.

    The hook runs after the interpreter joined its non-daemon threads and before it finalizes;
    a thread still running when ``exit_timeout_s`` passes is left to the interpreter (logged).

    Args:
        target: the thread's work.
        args: its positional arguments.
        name: the thread's name.
        exit_timeout_s: seconds the exit waits for the thread (how long its work may take once
            ``stop`` is set), or None to wait until it ends (work that cannot be stopped and
            would abort the process if ended).
        stop: the event the hook sets (a new one if None); pass the one ``args`` hands the
            target.
    """

    def __init__(self, target: Callable[..., Any], args: tuple = (), *, name: str,
                 exit_timeout_s: float | None, stop: threading.Event | None = None) -> None:
        super().__init__(target=target, args=args, name=name, daemon=True)
        self.exit_timeout_s = exit_timeout_s
        self.stop = stop if stop is not None else threading.Event()

    def start(self) -> None:
        """Register the exit hook, then start the thread (the exit may come at once)."""
        atexit.register(self._stop_and_join)
        try:
            super().start()
        except BaseException:
            atexit.unregister(self._stop_and_join)
            raise

    def run(self) -> None:
        """The target, then the exit hook dropped."""
        try:
            super().run()
        finally:
            atexit.unregister(self._stop_and_join)

    def _stop_and_join(self) -> None:
        self.stop.set()
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop waiting
            if self.exit_timeout_s is not None:
                self.join(self.exit_timeout_s)
            elif not self.join_within(_QUIET_S):
                logger.warning("exit: waiting for thread %s to end (it cannot be stopped; "
                               "Ctrl-C stops waiting)", self.name)
                self.join()
        if self.is_alive():
            logger.warning("exit: thread %s still runs; the interpreter ends it", self.name)

    def join_within(self, timeout_s: float) -> bool:
        """Join for up to ``timeout_s`` seconds; whether the thread ended."""
        self.join(timeout_s)
        return not self.is_alive()
