"""How ``kvflow serve`` stops on SIGINT (Ctrl-C) or SIGTERM (``docker stop``, Kubernetes).

uvicorn alone stops listening, then waits up to its graceful timeout for the open responses to
end: a stream that is still generating never does, so it was cancelled mid-body (the client's
stream cut without an error or ``[DONE]``, a CancelledError traceback in the log, seconds
later). Here the open requests are aborted first, as vLLM's server aborts them on shutdown:
each one's engine core frees its KV blocks, a stream ends with an error event (code
``server_shutting_down``) and ``data: [DONE]``, a non-streaming request gets a 503 with that
code, and new requests get the same 503. The responses then end at once and the server exits
within about a second; a second Ctrl-C exits without waiting for anything.
"""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from kvflow.engine.async_llm import AsyncLLM, EngineShutdownError

logger = logging.getLogger(__name__)


class AbortingServer(uvicorn.Server):
    """uvicorn's ``Server`` that, when it starts to shut down (a signal, or ``should_exit``),
    first aborts every open request of ``engine`` (``AsyncLLM.abort_all``) so their
    responses end at once instead of running out uvicorn's graceful timeout.

    Args:
        config: uvicorn's configuration.
        engine: the engine the app serves.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine.is_healthy:  # a dead engine has failed its requests already
            error = EngineShutdownError(f"the server is shutting down ({self._reason()}): "
                                        "the request was aborted")
            count = self.engine.abort_all(error)
            if count:
                logger.info("shutting down: aborted %d open request(s)", count)
        await super().shutdown(sockets)

    def _reason(self) -> str:
        """The signal that stopped the server (``SIGINT``), else ``stopped``."""
        captured = getattr(self, "_captured_signals", None)  # uvicorn's record of them
        if captured:
            return signal.Signals(captured[0]).name
        return "stopped"
