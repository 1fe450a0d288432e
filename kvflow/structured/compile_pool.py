"""Grammar compiles on threads, each with a time limit that frees its slot.

xgrammar's compiler is C++ that releases the GIL (measured: a Python thread kept ~57% of its
idle rate on 2 cores while ``root ::= [^"\\\\] | root{2,40}`` compiled for SmolLM2's 49,152
tokens in 14-20 s), so compiles on several threads run in parallel with each other and with
the step loop. Such a compile cannot be interrupted: a thread stuck in C can be neither
cancelled nor killed. ``CompilePool`` therefore runs each compile on a thread of its own and
counts at most ``num_threads`` of them as running; one past ``timeout_s`` is *abandoned*: its
future fails with ``CompileTimeoutError`` at once and the next queued compile takes its slot,
while the abandoned thread finishes in the background (its result is dropped). Abandoned
threads still use a core each, so at most ``max_threads`` compile threads live at once,
abandoned ones included: a queued compile starts only while fewer run, and once the abandoned
ones alone fill ``max_threads`` the pool is *saturated* (``is_saturated``): nothing starts until
one of them ends on its own, and the server refuses new compiles (429) instead of queueing
them behind threads that may run for minutes. A compile in a
child process could be killed instead, but every child would need its own tokenizer tables
(0.19 s measured to build for SmolLM2's 49k vocabulary, the tokenizer's load not counted;
a replacement costs that after every kill) and each compiled grammar would have to be
serialized back to the engine process; a thread costs ~0.2 ms a compile (measured: 233 us
per round trip vs 21 us on a ThreadPoolExecutor), next to compiles of a millisecond or more.

At interpreter exit every compile thread, abandoned ones included, is waited for until it
ends (logged after a second; Ctrl-C stops the wait) and no queued compile starts: a compile
thread that returned from xgrammar while the interpreter finalized aborted the process
(``terminate called without an active exception``, status 134; ``kvflow/runtime/exit_threads.py``),
and one cannot be stopped; vLLM's compile threads (a ``ThreadPoolExecutor``'s) are waited for
at exit too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvflow.runtime.exit_threads import ExitJoinedThread


class CompileTimeoutError(RuntimeError):
    """A grammar did not compile within the time limit."""


class CompilePool:
    """Runs ``fn(*args)`` compiles, at most ``num_threads`` at a time, each abandoned once it
    has run ``timeout_s`` seconds (``expire``), with at most ``max_threads`` compile threads
    alive, abandoned ones included. Thread-safe.

    Args:
        num_threads: compiles counted as running at once (queued ones wait for a slot).
        timeout_s: seconds a compile may run (time queued not counted) before ``expire``
            fails its future with ``CompileTimeoutError``.
        max_threads: compile threads alive at once, running and abandoned (None: twice
            ``num_threads``).
        clock: seconds, monotonic (tests pass a fake one).

    Raises:
        ValueError: if ``max_threads`` is below ``num_threads``.
    """

    def __init__(self, num_threads: int, timeout_s: float, max_threads: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_threads, self.timeout_s, self._clock = num_threads, timeout_s, clock
        self.max_threads = 2 * num_threads if max_threads is None else max_threads
        if self.max_threads < num_threads:
            raise ValueError(f"max_threads={max_threads} is below num_threads={num_threads}")
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._running: dict[Future, float] = {}  # future -> when its compile started
        self.num_abandoned = 0  # abandoned compiles whose threads still run
        self._closed = False
        self._exiting = threading.Event()  # set at interpreter exit: start no queued compile

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its future gets the result, the exception it raised, or
        ``CompileTimeoutError`` (from ``expire``)."""
        future: Future = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            self._start_queued()
        return future

    def expire(self) -> int:
        """Abandon every compile that has run longer than ``timeout_s`` (its future fails
        with ``CompileTimeoutError``) and start queued ones in the freed slots; returns how
        many were abandoned."""
        with self._lock:
            now = self._clock()
            late = [f for f, start in self._running.items() if now - start > self.timeout_s]
            for future in late:
                del self._running[future]
                self.num_abandoned += 1
                future.set_exception(CompileTimeoutError(
                    f"not compiled within {self.timeout_s:g} s"))
            self._start_queued()
        return len(late)

    @property
    def is_saturated(self) -> bool:
        """True while abandoned compiles alone hold ``max_threads`` threads: no compile can
        start until one of them ends by itself (a thread in C cannot be stopped)."""
        return self.num_abandoned >= self.max_threads

    def next_deadline(self) -> float | None:
        """When (``clock`` seconds) the earliest running compile will be past its limit;
        None when none runs."""
        with self._lock:
            starts = self._running.values()
            return min(starts) + self.timeout_s if starts else None

    def shutdown(self) -> None:
        """Cancel queued compiles; running threads finish on their own (daemon threads, waited
        for at interpreter exit)."""
        with self._lock:
            self._closed = True
            while self._queue:
                self._queue.popleft()[0].cancel()

    def _start_queued(self) -> None:  # with the lock held
        while (self._queue and len(self._running) < self.num_threads and not self._closed
               and not self._exiting.is_set()
               and len(self._running) + self.num_abandoned < self.max_threads):
            future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._running[future] = self._clock()
            ExitJoinedThread(self._run, (future, fn, args), name="kvflow-grammar",
                             exit_timeout_s=None, stop=self._exiting).start()

    def _run(self, future: Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the future's waiters
            result, error = None, e
        with self._lock:
            if self._running.pop(future, None) is None:  # abandoned: its future failed
                self.num_abandoned -= 1
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            self._start_queued()
