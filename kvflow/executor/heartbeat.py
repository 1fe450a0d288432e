"""Worker heartbeats of the multiprocess executor: a stopped or frozen worker is found in
seconds.

A worker process that is alive but does not run (``SIGSTOP``, a debugger, a machine that
swaps) keeps its peers waiting inside a collective until torch.distributed's timeout
(600 s): no exit status to poll, no error to report. So each worker, once ready, sends a
heartbeat every :data:`HEARTBEAT_INTERVAL_S` from a thread of its own (it runs during long
steps too: the main thread releases the GIL inside torch ops and collectives), stamped with
its ``time.monotonic()`` (one system-wide clock on Linux and macOS). The executor reads them
while it waits for replies and while idle (:class:`HeartbeatMonitor`), and fails the engine
naming the rank whose last heartbeat is older than ``worker_heartbeat_timeout``. The Ray
executor's actors do the same over TCP (they may run on other machines).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable

import zmq

HEARTBEAT_INTERVAL_S = 1.0  # a worker's heartbeat period (capped to a quarter of the timeout)

_FORMAT = "<Id"  # rank (uint32), the worker's time.monotonic() (float64)


def encode_beat(rank: int, stamp: float) -> bytes:
    """One heartbeat message: ``rank`` and the sender's ``time.monotonic()`` (seconds)."""
    return struct.pack(_FORMAT, rank, stamp)


def decode_beat(message: bytes) -> tuple[int, float]:
    """(rank, monotonic stamp in seconds) of a message made by :func:`encode_beat`."""
    rank, stamp = struct.unpack(_FORMAT, message)
    return rank, stamp


class HeartbeatSender:
    """A heartbeat thread: PUSHes ``encode(rank, time.monotonic())`` to ``address`` every
    ``interval_s`` (a worker's to its executor; an engine core's to the API process's output
    socket: ``kvflow/engine/core_heartbeat.py``).

    The thread owns its zmq context and socket (zmq sockets are not thread-safe).

    Args:
        rank: the worker's rank (an engine core: its data-parallel replica index).
        address: the socket to send to (``ipc://...``).
        interval_s: seconds between heartbeats.
        encode: makes one message from (rank, monotonic stamp in seconds); default
            :func:`encode_beat`.
    """

    def __init__(self, rank: int, address: str, interval_s: float,
                 encode: Callable[[int, float], bytes] = encode_beat) -> None:
        self.rank, self.address, self.interval_s = rank, address, interval_s
        self.encode = encode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvflow-heartbeat")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (within one interval) and close its socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 16)  # nobody reading: drop, never block
        push.connect(self.address)
        try:
            while True:
                try:
                    push.send(self.encode(self.rank, time.monotonic()), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if self._stop.wait(self.interval_s):
                    break
        finally:
            push.close(linger=0)
            ctx.term()


class HeartbeatMonitor:
    """The executor's view of its workers' heartbeats.

    Args:
        world_size: number of ranks.
        timeout_s: the longest a rank may go without a heartbeat (``worker_heartbeat_timeout``).
        now: the current ``time.monotonic()``; every rank counts as heard from then.

    A check that comes more than ``timeout_s / 2`` after the previous one (the engine
    process itself did not run: it was stopped too, or an offline engine sat idle with nobody
    checking) counts every rank as heard from at that moment instead of judging stale stamps.
    """

    def __init__(self, world_size: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last_beat = [now] * world_size
        self._last_check = now

    def beat(self, rank: int, stamp: float) -> None:
        """Record a heartbeat of ``rank`` sent at ``stamp`` (monotonic seconds)."""
        if 0 <= rank < len(self.last_beat):
            self.last_beat[rank] = max(self.last_beat[rank], stamp)

    def silent_ranks(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds since its last heartbeat) of every rank silent for longer than the
        timeout, as of ``now`` (call after recording every heartbeat received so far)."""
        if now - self._last_check > self.timeout_s / 2:
            self.last_beat = [max(t, now) for t in self.last_beat]
        self._last_check = now
        return [(rank, now - t) for rank, t in enumerate(self.last_beat)
                if now - t > self.timeout_s]


def drain_beats(sock: zmq.Socket, monitor: HeartbeatMonitor) -> set[int]:
    """Record in ``monitor`` every heartbeat waiting on ``sock``, without blocking; returns
    the ranks heard from. A message that is not a heartbeat (a stray peer of a TCP socket)
    is dropped."""
    heard: set[int] = set()
    while True:
        try:
            message = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return heard
        try:
            rank, stamp = decode_beat(message)
        except struct.error:
            continue
        monitor.beat(rank, stamp)
        heard.add(rank)


def describe_silence(rank: int, pid: int | None, silent_s: float, timeout_s: float,
                     state: str | None) -> str:
    """Why a worker is taken for frozen: ``"worker rank 1 (pid 4242) sent no heartbeat for
    2.1 s (worker_heartbeat_timeout=2): the process is stopped (SIGSTOP or SIGTSTP)"``
    (``state``: :func:`process_state`'s word, None where unknown)."""
    return (f"worker rank {rank} (pid {pid}) sent no heartbeat for {silent_s:.1f} s "
            f"(worker_heartbeat_timeout={timeout_s:g})"
            + (f": the process is {state}" if state else ""))


def process_state(pid: int) -> str | None:
    """A word on why process ``pid`` does not run, from ``/proc/<pid>/stat`` (Linux):
    'stopped' (SIGSTOP/SIGTSTP), 'stopped by a debugger', 'in uninterruptible sleep (I/O)',
    a zombie; None if it is running or sleeping normally, or the state cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return {"T": "stopped (SIGSTOP or SIGTSTP)", "t": "stopped by a debugger",
            "D": "in uninterruptible sleep (I/O)", "Z": "a zombie"}.get(state)
