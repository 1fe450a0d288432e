"""The stored side of /v1/responses (``serving_responses.OpenAIServingResponses.keeper``):
a request's ``store``, ``request_id`` and ``previous_response_id`` checked against the
``ResponseStore``, a finished reply stored, and the routes that read the store: GET (a
background response as it stands, or its stream followed again), DELETE, POST .../cancel and
GET .../input_items. Background runs themselves (their tasks and event logs) are
``responses_background.BackgroundResponses``, which this holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvflow.engine.async_llm import RequestStream
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol.responses_api import (
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from kvflow.entrypoints.responses_background import TERMINAL, BackgroundResponses
from kvflow.entrypoints.responses_input import input_items
from kvflow.entrypoints.responses_store import (
    ResponseStore,
    StoredResponse,
    item_page,
    output_messages,
)
from kvflow.entrypoints.streaming import SSEResponse
from kvflow.entrypoints.structured_requests import RequestFieldError


class ResponseKeeper:
    """The replies kept in ``store`` and the background runs over it (``background``);
    ``abort(streams)`` ends engine requests (the chat handler's). Call :meth:`shutdown` when
    the server stops."""

    def __init__(self, store: ResponseStore,
                 abort: Callable[[Sequence[RequestStream]], None]) -> None:
        self.store = store
        self.background = BackgroundResponses(store, abort)

    async def shutdown(self) -> None:
        """Cancel the running background responses (their engine requests aborted, each
        stored as ``cancelled``)."""
        await self.background.runs.shutdown()

    def check(self, req: ResponsesRequest) -> None:
        """A new request's ``store``, ``background`` and ``request_id`` against the store
        (a request without ``store`` is told ``store`` false when the store is off).

        Raises:
            OpenAIError: 400 naming ``store`` (sent true, store off), ``background``
                (without ``store``) or ``request_id`` (:meth:`check_request_id`); 429 when
                ``--responses-store-size`` background responses run already.
        """
        self._check_store(req)
        self.background.check(req)
        self.check_request_id(req)

    def _check_store(self, req: ResponsesRequest) -> None:
        """With the store off (capacity 0) a reply is not stored and says so (``store``
        false, as vLLM's does with its store off); a request that sent ``store: true``
        itself asks for what the server cannot do: a 400 naming ``store``."""
        if self.store.capacity == 0 and req.store:
            if "store" in req.model_fields_set:
                raise OpenAIError("store=true is not possible: this server keeps no replies "
                                  "(--responses-store-size 0); send store false or leave it "
                                  "out", param="store", code="unsupported_parameter")
            req.store = False

    def check_request_id(self, req: ResponsesRequest) -> None:
        """A ``request_id`` (vLLM 0.32's: the response's id as sent) may name a stored reply
        that has ended (this one replaces it when stored, as vLLM's store replaces it), not a
        background one still running: GET, cancel and its stored stream would then name two
        responses.

        Raises:
            OpenAIError: 400 naming ``request_id`` for the id of a running background
                response.
        """
        if req.request_id is None:
            return
        stored = self.store.peek(req.request_id)
        if stored is not None and stored.response.status not in TERMINAL:
            raise OpenAIError(f"request_id {req.request_id[:100]!r} is the id of a background "
                              f"response still {stored.response.status}: cancel it or wait "
                              "until it ends, or send another id", param="request_id",
                              code="invalid_value")

    def earlier(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation (chat messages) that ``previous_response_id`` continues; [] for
        None.

        Raises:
            OpenAIError: 404 naming ``previous_response_id`` when it is not stored, 400 when
                it is a background response still running.
        """
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise OpenAIError(f"previous response {previous_response_id!r} is not stored "
                              f"({self._kept()})", 404, "invalid_request_error",
                              "previous_response_id", "previous_response_not_found")
        if stored.response.status not in TERMINAL:
            raise OpenAIError(f"previous response {previous_response_id!r} is still "
                              f"{stored.response.status} (background): wait until it ends",
                              param="previous_response_id", code="invalid_value")
        return stored.messages

    def keep(self, req: ResponsesRequest, response: ResponseObject,
             turns: list[dict[str, Any]]) -> None:
        """Store the finished ``response`` when ``req.store`` (``turns``: its conversation
        before it, the output joins them), unless it was sent with the ``request_id`` of a
        background response that started meanwhile and still runs: that one keeps the id. A
        background response keeps its own stored event log."""
        earlier = self.store.peek(response.id)  # a background run's own: keeps its log
        if req.store and (req.background or earlier is None
                          or earlier.response.status in TERMINAL):
            self.store.put(StoredResponse(
                response, turns + output_messages(response.output), input_items(req.input),
                earlier.log if earlier is not None and req.background else None))

    def retrieve(self, response_id: str) -> ResponseObject:
        """A stored reply (GET /v1/responses/{id}); a background one as it stands
        (``queued`` / ``in_progress`` while it runs, with the output generated so far).

        Raises:
            OpenAIError: 404 when no reply of that id is stored.
        """
        return self.background.current(self._stored(response_id))

    def follow(self, response_id: str, after: int) -> SSEResponse:
        """GET /v1/responses/{id}?stream=true&starting_after=N: a background streamed
        response's events after sequence number ``after`` (-1: all), then live ones until it
        ends.

        Raises:
            OpenAIError: 404 when no reply of that id is stored; 400 naming ``stream`` for
                one not created with ``background`` and ``stream`` true.
        """
        return self.background.follow(self._stored(response_id), after)

    async def cancel(self, response_id: str) -> ResponseObject:
        """POST /v1/responses/{id}/cancel: stop a running background response (its engine
        requests aborted) and return it ``cancelled``; one that has ended is returned as it
        is (a repeated cancel answers the same, OpenAI's rule).

        Raises:
            OpenAIError: 404 when no reply of that id is stored; 400 naming ``response_id``
                for one not created with ``background`` true.
        """
        await self.background.cancel(self._stored(response_id))
        return self._stored(response_id).response

    async def delete(self, response_id: str) -> ResponseDeleted:
        """Forget a stored reply (DELETE /v1/responses/{id}), cancelling it first if it runs
        in the background; a later GET, input_items or ``previous_response_id`` naming it is a
        404.

        Raises:
            OpenAIError: 404 when no reply of that id is stored.
        """
        self._stored(response_id)
        await self.background.runs.cancel(response_id)
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    def input_items(self, response_id: str, query: Mapping[str, list[str]]
                    ) -> ResponseItemList:
        """A page of a stored reply's input items (GET /v1/responses/{id}/input_items;
        ``query``: its query parameters' values, see ``responses_store.item_page``).

        Raises:
            OpenAIError: 404 when no reply of that id is stored, 400 naming a bad query
                parameter.
        """
        stored = self._stored(response_id)
        try:
            return item_page(stored.input_items, query)
        except RequestFieldError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None

    def _kept(self) -> str:
        if self.store.capacity == 0:
            return "this server keeps no replies: --responses-store-size 0"
        return (f"replies are kept in memory, the last {self.store.capacity} "
                "(--responses-store-size), when sent with store true")

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"no response with id {response_id[:100]!r} is stored "
                              f"({self._kept()})", 404, "invalid_request_error",
                              code="response_not_found")
        return stored
