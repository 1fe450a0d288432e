"""How ``kvflow serve`` stops on SIGINT (Ctrl-C) or SIGTERM (``docker stop``, Kubernetes).

uvicorn alone stops listening, then waits up to its graceful timeout for the open responses to
end: a stream that is still generating never does, so it was cancelled mid-body (the client's
stream cut without an error or ``[DONE]``, a CancelledError traceback in the log, seconds
later). Here the open requests are aborted first, as vLLM's server aborts them on shutdown:
each one's engine core frees its KV blocks, a stream ends with an error event (code
``server_shutting_down``) and ``data: [DONE]``, a non-streaming request gets a 503 with that
code, and new requests get the same 503. The responses then end at once and the server exits
within about a second; a second Ctrl-C exits without waiting for anything. SIGTERM while the
model loads (before uvicorn handles signals) stops the load as Ctrl-C does
(``sigterm_stops_loading``). Requests that
uvicorn cancels then (or after its graceful timeout: a client that never sends its whole body)
are not logged with a traceback each: uvicorn's own line says how many it cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

from kvflow.engine.async_llm import AsyncLLM, EngineShutdownError

logger = logging.getLogger(__name__)


class AbortingServer(uvicorn.Server):
    """uvicorn's ``Server`` that, when it starts to shut down (a signal, or ``should_exit``),
    first aborts every open request of ``engine`` (``AsyncLLM.abort_all``) so their
    responses end at once instead of running out uvicorn's graceful timeout.

    With ``drain_timeout_s`` > 0 (vLLM's ``--shutdown-timeout``) new requests are refused
    first (503, code ``server_shutting_down``) while the open ones run on for up to that
    many seconds; those still open then are aborted. A second Ctrl-C ends the wait.

    Args:
        config: uvicorn's configuration.
        engine: the engine the app serves.
        drain_timeout_s: seconds open requests may take to finish (0: aborted at once).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM,
                 drain_timeout_s: float = 0.0) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logging.getLogger("uvicorn.error").addFilter(drop_cancelled_tracebacks)
        if self.engine.is_healthy:  # a dead engine has failed its requests already
            if self.drain_timeout_s > 0:
                await self._drain()
            error = EngineShutdownError(f"the server is shutting down ({self._reason()}): "
                                        "the request was aborted")
            count = self.engine.abort_all(error)
            if count:
                logger.info("shutting down: aborted %d open request(s)", count)
        await super().shutdown(sockets)

    async def _drain(self) -> None:
        """Refuse new requests, then wait until no request is open, ``drain_timeout_s``
        passed, or a second signal came (uvicorn's ``force_exit``)."""
        self.engine.refuse_new(EngineShutdownError(
            f"the server is shutting down ({self._reason()}): it takes no new requests"))
        count = self.engine.num_open_requests
        if not count:
            return
        logger.info("shutting down: waiting up to %g s for %d open request(s) to finish "
                    "(--shutdown-timeout)", self.drain_timeout_s, count)
        deadline = time.monotonic() + self.drain_timeout_s
        while self.engine.num_open_requests and time.monotonic() < deadline \
                and not self.force_exit:
            await asyncio.sleep(0.05)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler: the engine notes the shutdown (``begin_shutdown``); a
        second Ctrl-C (uvicorn's ``force_exit``) also stops the engine cores without their
        grace (``AsyncLLM.hurry_shutdown``): one still in a long step gets SIGTERM at once
        (was: the second Ctrl-C still waited out its 1 s)."""
        super().handle_exit(sig, frame)
        self.engine.begin_shutdown()
        if self.force_exit:
            self.engine.hurry_shutdown()

    def end_as_signalled(self) -> None:
        """After :meth:`run` returned: end as the signal that stopped the server ends a process
        where uvicorn's own re-raise of it did nothing (the process started with that signal
        ignored, as a background job of a non-interactive shell does SIGINT: it exited 0).

        Raises:
            KeyboardInterrupt: for SIGINT (``kvflow`` then exits 130); SIGTERM ends the
                process by that signal instead.
        """
        for signum in getattr(self, "_captured_signals", ()):  # uvicorn's record of them
            if signal.getsignal(signum) is not signal.SIG_IGN:
                continue  # uvicorn re-raised it to a handler that acts
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _reason(self) -> str:
        """The signal that stopped the server (``SIGINT``), else ``stopped``."""
        captured = getattr(self, "_captured_signals", None)  # uvicorn's record of them
        if captured:
            return signal.Signals(captured[0]).name
        return "stopped"


def drop_cancelled_tracebacks(record: logging.LogRecord) -> bool:
    """A ``logging`` filter (installed on ``uvicorn.error`` once shutdown starts): False for a
    record carrying a CancelledError or KeyboardInterrupt, or the text of a traceback ending in
    CancelledError (the lifespan task's, which starlette hands over as text): a request or the
    lifespan cancelled on purpose, ~50 lines each, where uvicorn has said what it cancelled."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
        return False
    text = record.msg if isinstance(record.msg, str) else ""  # the lifespan's, as text
    return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


@contextlib.contextmanager
def sigterm_stops_loading() -> Iterator[None]:
    """Within: SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so an engine start-up
    unwinds (``AsyncLLM`` stops its processes and removes its folders); leaving by it, the
    process then ends by SIGTERM. Its default action had ended the API process alone, the
    engine-core and worker processes loading on and their folders left (a pod replaced while
    the model loads; benchmarks/server_signals.py sigterm-loading). A no-op outside the main
    thread (no signal handler can be set there).

    Raises:
        KeyboardInterrupt: for Ctrl-C (SIGTERM ends the process instead).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def _interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    except KeyboardInterrupt:
        if received:  # cleaned up: now end as SIGTERM ends a process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
