"""Responses API background mode (``background: true``, OpenAI's): POST /v1/responses
answers at once with the response ``queued``, and the generation runs as a server task; GET
/v1/responses/{id} polls its status (``queued`` -> ``in_progress`` -> ``completed`` /
``incomplete`` / ``failed`` / ``cancelled``) and, while it runs, the output generated so far
(``BackgroundResponses.current``); POST .../cancel stops it.

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
import copy
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from kvflow.engine.async_llm import EngineDeadError, RequestRefused, RequestStream
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol.responses_api import ResponseObject, ResponsesRequest
from kvflow.entrypoints.responses_events import ResponseEvents, sse_lines
from kvflow.entrypoints.responses_store import ResponseStore, StoredResponse, output_messages
from kvflow.entrypoints.streaming import SSEResponse

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


def ended_response(response: ResponseObject, task: asyncio.Task,
                   items: Sequence[dict[str, Any]] = (), usage: Any = None
                   ) -> ResponseObject | None:
    """The final response of a background run whose ``task`` ended, from ``response`` (the
    last stored for it), or None when it is final already (the run stored it): ``cancelled``
    when the task was cancelled, with ``output`` the ``items`` produced until then
    (``partial_output``; OpenAI keeps a cancelled response's output) and ``usage`` the token
    counts of that output and the prompt (a ``ResponseUsage``, as a finished reply's; None
    when the run had not started), ``failed`` (``error.code`` ``server_error``) when it
    raised."""
    if response.status in TERMINAL:
        return None
    if task.cancelled():
        return response.model_copy(update={"status": "cancelled", "usage": usage,
                                           "output": partial_output(items)})
    error = task.exception()
    if error is None:  # the run stored nothing: cannot happen, but never leave it running
        error = RuntimeError("the background run ended without a response")
    if not isinstance(error, (EngineDeadError, RequestRefused)):
        logger.error("background response %s failed", response.id, exc_info=error)
    return failed_response(response, error)


def partial_output(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the output ``items`` of a reply stopped mid-way (``ResponseEvents.items``),
    the one still open (``in_progress``) marked ``incomplete``, as OpenAI marks an item the
    reply's end cut."""
    out = copy.deepcopy(list(items))
    for item in out:
        if item["status"] == "in_progress":
            item["status"] = "incomplete"
    return out


def failed_response(response: ResponseObject, error: BaseException) -> ResponseObject:
    """``response`` as ``failed``, its ``error`` OpenAI's (``code`` one of OpenAI's: a
    request the engine core refused as busy is ``rate_limit_exceeded``, as bad
    ``invalid_prompt``, anything else ``server_error``; ``message`` says what happened)."""
    code = "server_error"
    if isinstance(error, RequestRefused):
        code = "invalid_prompt" if error.retry_after_s is None else "rate_limit_exceeded"
    return response.model_copy(update={"status": "failed",
                                       "error": {"code": code, "message": str(error)}})


class BackgroundResponses:
    """The background side of /v1/responses over ``store``: checks a request, starts a run,
    follows its stream, cancels it. ``abort(streams)`` ends engine requests (the chat
    handler's: beam searches too)."""

    def __init__(self, store: ResponseStore,
                 abort: Callable[[Sequence[RequestStream]], None]) -> None:
        self.store = store
        self._abort = abort
        self.runs = BackgroundRuns(self._ended)
        self._outputs: dict[str, ResponseEvents] = {}  # a running response's items so far

    def check(self, req: ResponsesRequest) -> None:
        """``background`` needs ``store`` (a 400 naming ``background``, as OpenAI's), and a
        free place: at most ``store.capacity`` run at once (a 429 past that).

        Raises:
            OpenAIError: as said; nothing for a request without ``background``.
        """
        if not req.background:
            return
        if not req.store:
            off = " (this server keeps no replies: --responses-store-size 0)" \
                if self.store.capacity == 0 else ""
            raise OpenAIError("background=true needs store=true: a background response is "
                              f"read back from the store{off}", param="background",
                              code="invalid_value")
        self._check_free()

    def _check_free(self) -> None:
        if not self.store.can_hold():
            raise OpenAIError(f"{self.store.num_held} background responses are running, the "
                              "most this server runs at once (--responses-store-size); retry "
                              "later or cancel one", 429, "rate_limit_exceeded",
                              param="background", code="too_many_background_responses",
                              headers={"Retry-After": "1"})

    def start(self, stored: StoredResponse, events: AsyncIterator[Event],
              counter: ResponseEvents, streams: Sequence[RequestStream], stream: bool
              ) -> Response:
        """Hold ``stored`` (its response ``queued``: never dropped while it runs), run
        ``events`` (the reply's events, from ``response.created``; ``counter`` numbers them)
        as a task, and answer with the response (``stream``: with its events as they come;
        the run goes on if the client leaves).

        Raises:
            OpenAIError: 429 when others took the last free place meanwhile (``streams``
                are aborted then).
        """
        if not self.store.can_hold():  # others started while this one was rendered
            self._abort(streams)
            self._check_free()
        stored.log = EventLog() if stream else None
        self.store.hold(stored)
        response_id = stored.response.id
        self._outputs[response_id] = counter
        self.runs.start(response_id, self._run(response_id, events, counter, stored.log),
                        lambda: self._abort(streams))
        if stored.log is not None:
            return SSEResponse(sse_lines(stored.log.follow(-1)))
        return Response(stored.response.model_dump_json(), media_type="application/json")

    def current(self, stored: StoredResponse) -> ResponseObject:
        """``stored``'s response as GET /v1/responses/{id} shows it: while it runs, with
        ``output`` the items generated so far (copies of ``ResponseEvents.items``: the open
        one ``in_progress``, its text growing from poll to poll; empty while ``queued``), as
        OpenAI's polling shows a running response; once ended, the stored response as is."""
        counter = self._outputs.get(stored.response.id)
        if counter is None or stored.response.status in TERMINAL:
            return stored.response
        return stored.response.model_copy(update={"output": copy.deepcopy(counter.items)})

    def follow(self, stored: StoredResponse, after: int) -> SSEResponse:
        """The stream of a background streamed response after sequence number ``after``.

        Raises:
            OpenAIError: 400 naming ``stream`` for one not created with ``background`` and
                ``stream`` true.
        """
        if stored.log is None:
            raise OpenAIError("only a response created with background and stream true can "
                              "be streamed again (GET without stream returns this one)",
                              param="stream", code="invalid_value")
        return SSEResponse(sse_lines(stored.log.follow(after)))

    async def cancel(self, stored: StoredResponse) -> None:
        """Stop ``stored`` if it runs (no-op once it ended).

        Raises:
            OpenAIError: 400 naming ``response_id`` for a reply not created with
                ``background`` true.
        """
        if not stored.response.background:
            raise OpenAIError("only a response created with background true can be cancelled "
                              "(this one ran while its request waited)", param="response_id",
                              code="invalid_value")
        await self.runs.cancel(stored.response.id)

    async def _run(self, response_id: str, events: AsyncIterator[Event],
                   counter: ResponseEvents, log: EventLog | None) -> None:
        """The task of a background response: its events into ``log``, its status
        ``in_progress`` once it runs (the events' producer stores it finished); an engine
        failure or refusal stores it ``failed`` (with a ``response.failed`` event)."""
        try:
            async for event in events:
                if event["type"] == "response.in_progress":
                    self._restore(response_id, lambda r: r.model_copy(
                        update={"status": "in_progress"}))
                if log is not None:
                    log.append(event)
        except (EngineDeadError, RequestRefused) as error:
            failed = self._restore(response_id, lambda r, e=error: failed_response(r, e))
            if log is not None and failed is not None:
                log.append(counter.event("response.failed", response=failed.model_dump()))

    def _ended(self, response_id: str, task: asyncio.Task) -> None:
        """A run's task ended (its engine requests aborted already): a cancelled or crashed
        one is stored ``cancelled`` (with the output produced so far, which a later
        ``previous_response_id`` continues from, and its token usage) / ``failed``; its log
        closed, its hold released."""
        stored = self.store.peek(response_id)
        counter = self._outputs.pop(response_id, None)
        items = counter.items if counter is not None else []
        usage = counter.usage() if counter is not None and counter.usage is not None else None
        if stored is not None:
            before = stored.response.status
            ended = self._restore(response_id,
                                  lambda r: ended_response(r, task, items, usage) or r)
            if before not in TERMINAL and ended is not None and ended.status == "cancelled":
                stored.messages += output_messages(ended.output)
            if stored.log is not None:
                stored.log.close()
        self.store.release(response_id)

    def _restore(self, response_id: str, change: Callable[[ResponseObject], ResponseObject]
                 ) -> ResponseObject | None:
        """Replace the stored response of ``response_id`` with ``change(response)``; None
        when it is no longer stored."""
        stored = self.store.peek(response_id)
        if stored is None:
            return None
        stored.response = change(stored.response)
        return stored.response
