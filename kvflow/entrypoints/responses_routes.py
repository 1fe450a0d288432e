"""The Responses API's routes (OpenAI's ``/v1/responses``): create, retrieve, delete, list a
stored reply's input items, cancel. ``api_server.build_app`` adds them; the work is
``serving_responses.OpenAIServingResponses`` (``app.state.responses``).
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
    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await raw.app.state.responses.create_response(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request) -> Response:
        """A reply stored by POST /v1/responses (``store`` true).

        Raises:
            OpenAIError: 404 for an id not stored; 400 for a query parameter (OpenAI's
                ``include``, ``stream``, ``starting_after`` are not honoured).
        """
        _refuse_query(raw)
        stored = raw.app.state.responses.retrieve(response_id)
        return Response(stored.model_dump_json(), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request) -> ResponseDeleted:
        """Forget a stored reply: ``{"id", "object": "response.deleted", "deleted": true}``.

        Raises:
            OpenAIError: 404 for an id not stored; 400 for a query parameter.
        """
        _refuse_query(raw)
        return raw.app.state.responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request) -> ResponseItemList:
        """A page of a stored reply's input items (``order``, ``limit``, ``after``).

        Raises:
            OpenAIError: 404 for an id not stored; 400 naming a bad query parameter.
        """
        query = {name: raw.query_params.getlist(name) for name in raw.query_params}
        return raw.app.state.responses.input_items(response_id, query)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request) -> Response:
        """OpenAI's cancel of a background response. kvflow runs none in the background
        (``background`` true is refused), so a stored reply has already finished: a 400 as
        OpenAI answers for a response not created with ``background`` true.

        Raises:
            OpenAIError: 404 for an id not stored; 400 for a stored one, a query
                parameter, or a body (the route takes none).
        """
        _refuse_query(raw)
        if (await raw.body()).strip() not in (b"", b"{}"):
            raise OpenAIError("POST /v1/responses/{response_id}/cancel takes no body",
                              code="unsupported_parameter")
        raw.app.state.responses.retrieve(response_id)  # 404 unless stored
        raise OpenAIError("only a response created with background true can be cancelled "
                          "(kvflow runs no response in the background)",
                          param="response_id")


def _refuse_query(raw: Request) -> None:
    if raw.query_params:
        name = next(iter(raw.query_params))
        raise OpenAIError(f"the query parameter {name} is not supported by kvflow",
                          param=name, code="unsupported_parameter")
