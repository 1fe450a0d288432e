"""Responses API background mode (``background: true``, OpenAI's): POST /v1/responses
answers at once with the response ``queued``, and the generation runs as a server task; GET
/v1/responses/{id} polls its status (``queued`` -> ``in_progress`` -> ``completed`` /
``incomplete`` / ``failed`` / ``cancelled``), POST .../cancel stops it.

Invariants: a running response is held by the ``ResponseStore`` (never dropped; at most
``--responses-store-size`` run at once, a 429 past that); its engine requests are aborted
whenever its task ends for any reason (finished, cancelled, failed, server shutdown), so no
KV block outlives it. A response created with ``stream: true`` too keeps its stream events in
an ``EventLog`` (stored with it), which any number of readers follow from a sequence number
(GET /v1/responses/{id}?stream=true&starting_after=N): the events after N, then live ones
until the response ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvflow.engine.async_llm import EngineDeadError, RequestRefused
from kvflow.entrypoints.protocol.responses_api import ResponseObject

logger = logging.getLogger(__name__)

Event = dict[str, Any]
# statuses a response ends in; ``queued`` / ``in_progress`` are the running ones
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


class EventLog:
    """The stream events of one background response, in order (event ``i`` has
    ``sequence_number`` ``i``), for replay and live following. Single event loop only."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = False
        self._changed = asyncio.Event()

    def append(self, event: Event) -> None:
        """Add the next event (its ``sequence_number`` must be ``len(events)``).

        Raises:
            ValueError: for an event out of order or after ``close``.
        """
        if self.done or event["sequence_number"] != len(self.events):
            raise ValueError(f"event {event['sequence_number']} out of order: the log holds "
                             f"{len(self.events)} (done: {self.done})")
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        """No more events: followers end once they have read them all (idempotent)."""
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[Event]:
        """The events with ``sequence_number`` > ``after`` (-1: all), then each new one as
        it comes, until the log is closed."""
        index = after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            await self._changed.wait()


@dataclass
class BackgroundRun:
    """One running background response: its task and what stops its engine requests."""

    task: asyncio.Task
    abort: Callable[[], None]


class BackgroundRuns:
    """The server's running background responses by id (one ``asyncio.Task`` each).

    ``on_end(response_id, task)`` runs once per response when its task ends (done, failed
    or cancelled, even before it first ran): it records the final status; the run's
    ``abort`` is called first, so its engine requests end with it."""

    def __init__(self, on_end: Callable[[str, asyncio.Task], None]) -> None:
        self._runs: dict[str, BackgroundRun] = {}
        self._on_end = on_end

    def start(self, response_id: str, work: Coroutine[Any, Any, None],
              abort: Callable[[], None]) -> None:
        """Run ``work`` as a task for ``response_id``; ``abort`` stops its engine requests
        (no-op once they finished)."""
        task = asyncio.get_running_loop().create_task(work, name=f"background {response_id}")
        self._runs[response_id] = BackgroundRun(task, abort)
        task.add_done_callback(lambda t: self._ended(response_id))

    def running(self, response_id: str) -> bool:
        return response_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    async def cancel(self, response_id: str) -> None:
        """Stop a running response: abort its engine requests (their KV blocks are freed at
        the core's next step), cancel its task and wait until it has ended (``on_end`` has
        run). No-op for one not running."""
        run = self._runs.get(response_id)
        if run is None:
            return
        run.abort()
        run.task.cancel()
        await asyncio.wait([run.task])
        self._ended(response_id)

    async def shutdown(self) -> None:
        """Cancel every running response (the server stops)."""
        for response_id in list(self._runs):
            await self.cancel(response_id)

    def _ended(self, response_id: str) -> None:
        run = self._runs.pop(response_id, None)
        if run is None:
            return  # already ended (cancel and the done callback both call this)
        run.abort()
        self._on_end(response_id, run.task)


def ended_response(response: ResponseObject, task: asyncio.Task) -> ResponseObject | None:
    """The final response of a background run whose ``task`` ended, from ``response`` (the
    last stored for it), or None when it is final already (the run stored it): ``cancelled``
    when the task was cancelled, ``failed`` (``error.code`` ``server_error``) when it
    raised."""
    if response.status in TERMINAL:
        return None
    if task.cancelled():
        return response.model_copy(update={"status": "cancelled"})
    error = task.exception()
    if error is None:  # the run stored nothing: cannot happen, but never leave it running
        error = RuntimeError("the background run ended without a response")
    if not isinstance(error, (EngineDeadError, RequestRefused)):
        logger.error("background response %s failed", response.id, exc_info=error)
    return failed_response(response, error)


def failed_response(response: ResponseObject, error: BaseException) -> ResponseObject:
    """``response`` as ``failed``, its ``error`` OpenAI's (``code`` one of OpenAI's: a
    request the engine core refused as busy is ``rate_limit_exceeded``, as bad
    ``invalid_prompt``, anything else ``server_error``; ``message`` says what happened)."""
    code = "server_error"
    if isinstance(error, RequestRefused):
        code = "invalid_prompt" if error.retry_after_s is None else "rate_limit_exceeded"
    return response.model_copy(update={"status": "failed",
                                       "error": {"code": code, "message": str(error)}})
