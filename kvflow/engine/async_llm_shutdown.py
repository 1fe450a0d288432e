"""How :class:`kvflow.engine.async_llm.AsyncLLM` stops serving: aborting or draining the open
requests (``--shutdown-timeout``), refusing new ones, and the flags a signal handler sets
(``begin_shutdown``, ``hurry_shutdown``), failing every request and the teardown
(``fail_all``, ``shutdown``, ``close``). AsyncLLM's base class."""

from __future__ import annotations

from kvflow.engine.messages import AbortRequests
from kvflow.engine.streams import EngineDeadError, EngineShutdownError


class AsyncLLMShutdown:
    """The shutdown side of :class:`~kvflow.engine.async_llm.AsyncLLM`, which sets
    ``replicas``, ``requests``, ``_calls``, ``_dead`` and ``_outputs`` that these use."""

    def abort_all(self, error: EngineShutdownError) -> int:
        """Abort every open request in its engine core (their KV blocks are freed), end its
        stream with ``error``, and refuse new requests with it (the server is stopping);
        returns how many requests were open.

        Pending LoRA calls fail with ``error`` too.
        """
        self._dead = error
        count = len(self.requests.streams)
        for replica, sample_ids in self.requests.abort_all(error).items():
            self.replicas.send(replica, AbortRequests(sample_ids))
        self._calls.fail(error)
        return count

    def refuse_new(self, error: EngineShutdownError) -> None:
        """Refuse new requests with ``error`` while the open ones run on (a draining
        shutdown, ``--shutdown-timeout``); :meth:`abort_all` ends those left."""
        self._dead = error

    @property
    def num_open_sequences(self) -> int:
        """Samples of the requests in flight, waiting or running (``n`` per request)."""
        return self.requests.output_processor.num_open_samples

    @property
    def num_open_requests(self) -> int:
        """Requests whose final output has not been delivered yet."""
        return len(self.requests.streams)

    def begin_shutdown(self) -> None:
        """Note that the server is stopping (a signal): a core ending from now on is part of
        it, logged at INFO rather than as a lost replica's ERROR (SIGTERM to the server and
        its core at once: ``pkill -f "kvflow serve"``, a systemd stop). Only sets a flag, so
        it may run in a signal handler."""
        self.replicas.stopping = True

    @property
    def is_stopping(self) -> bool:
        """Whether :meth:`begin_shutdown` was called."""
        return self.replicas.stopping

    def hurry_shutdown(self) -> None:
        """Stop the engine cores without their grace: from now on :meth:`close` (or
        :meth:`shutdown`) sends a core still in its step SIGTERM at once instead of after
        ``STEP_GRACE_S`` (1 s; ``ReplicaSet.hurry``). A server calls it on a second Ctrl-C,
        when the user wants no more waiting; it only sets a flag, so it may run in a signal
        handler, before or while the cores are being stopped, and more than once."""
        self.replicas.hurry = True

    def fail_all(self, error: EngineDeadError) -> None:
        """End every open request with ``error`` and refuse new ones (the server is
        stopping)."""
        self._dead = error
        self.requests.fail_all(error)
        self._calls.fail(error)

    async def shutdown(self) -> None:
        """Stop the output loop and the core processes; release the sockets."""
        if self._outputs is not None:
            await self._outputs.stop()
        self.close()

    def close(self) -> None:
        """Synchronous teardown (idempotent): ask the cores to stop, then make sure they do;
        release the sockets and the IPC directory."""
        self.replicas.close(self._outputs.socket if self._outputs is not None else None)
