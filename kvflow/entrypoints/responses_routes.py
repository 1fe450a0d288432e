"""The Responses API's routes (OpenAI's ``/v1/responses``): create, retrieve, delete, list a
stored reply's input items, cancel. ``api_server.build_app`` adds them; the work is
``serving_responses.OpenAIServingResponses`` (``app.state.responses``; the routes that read
stored replies, its ``keeper``: ``responses_keeper.ResponseKeeper``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol.responses_api import (
    ResponseDeleted,
    ResponseItemList,
    ResponsesRequest,
)


def add_responses_routes(app: FastAPI) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items and
    POST .../cancel."""
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", response_input_items,
                      methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])


async def responses(req: ResponsesRequest, raw: Request) -> Response:
    return await raw.app.state.responses.create_response(req, raw)


async def retrieve_response(response_id: str, raw: Request) -> Response:
    """A reply stored by POST /v1/responses (``store`` true); with ``stream=true`` (and
    ``starting_after=N``) a background streamed response's events after N, then live.

    Raises:
        OpenAIError: 404 for an id not stored; 400 naming a bad query parameter
            (OpenAI's ``include`` is not honoured).
    """
    after = _stream_query(raw)
    if after is not None:
        return raw.app.state.responses.keeper.follow(response_id, after)
    stored = raw.app.state.responses.keeper.retrieve(response_id)
    return Response(stored.model_dump_json(), media_type="application/json")


async def delete_response(response_id: str, raw: Request) -> ResponseDeleted:
    """Forget a stored reply (a running background one is cancelled first):
    ``{"id", "object": "response.deleted", "deleted": true}``.

    Raises:
        OpenAIError: 404 for an id not stored; 400 for a query parameter.
    """
    _refuse_query(raw)
    return await raw.app.state.responses.keeper.delete(response_id)


async def response_input_items(response_id: str, raw: Request) -> ResponseItemList:
    """A page of a stored reply's input items (``order``, ``limit``, ``after``).

    Raises:
        OpenAIError: 404 for an id not stored; 400 naming a bad query parameter.
    """
    query = {name: raw.query_params.getlist(name) for name in raw.query_params}
    return raw.app.state.responses.keeper.input_items(response_id, query)


async def cancel_response(response_id: str, raw: Request) -> Response:
    """OpenAI's cancel of a background response: a running one is stopped and returned
    ``cancelled``, one that has ended is returned as it is.

    Raises:
        OpenAIError: 404 for an id not stored; 400 for one not created with
            ``background`` true, a query parameter, or a body (the route takes none).
    """
    _refuse_query(raw)
    if (await raw.body()).strip() not in (b"", b"{}"):
        raise OpenAIError("POST /v1/responses/{response_id}/cancel takes no body",
                          code="unsupported_parameter")
    response = await raw.app.state.responses.keeper.cancel(response_id)
    return Response(response.model_dump_json(), media_type="application/json")


def _refuse_query(raw: Request) -> None:
    if raw.query_params:
        name = next(iter(raw.query_params))
        raise OpenAIError(f"the query parameter {name} is not supported by kvflow",
                          param=name, code="unsupported_parameter")


def _stream_query(raw: Request) -> int | None:
    """GET /v1/responses/{id}'s query: ``stream`` (true / false) and ``starting_after`` (a
    sequence number, -1 or more; only with ``stream=true``). Returns the sequence number to
    stream after (-1 when ``starting_after`` is absent), None for no stream.

    Raises:
        OpenAIError: 400 naming a bad, repeated or unknown parameter.
    """
    for name in raw.query_params:
        if name not in ("stream", "starting_after"):
            raise OpenAIError(f"the query parameter {name} is not supported by kvflow (GET "
                              "/v1/responses/{id} reads stream, starting_after)",
                              param=name, code="unsupported_parameter")
        if len(raw.query_params.getlist(name)) != 1:
            raise OpenAIError(f"{name} given more than once", param=name,
                              code="invalid_value")
    stream = raw.query_params.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise OpenAIError(f"stream must be true or false; got {stream!r}", param="stream",
                          code="invalid_value")
    after = raw.query_params.get("starting_after")
    if after is None:
        return -1 if stream == "true" else None
    if stream != "true":
        raise OpenAIError("starting_after needs stream=true", param="starting_after",
                          code="invalid_value")
    if not after.lstrip("-").isdigit() or int(after) < -1:
        raise OpenAIError(f"starting_after must be an integer, -1 or more; got {after!r}",
                          param="starting_after", code="invalid_value")
    return int(after)
