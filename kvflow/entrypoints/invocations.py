"""POST /invocations (SageMaker's inference route, as vLLM serves it): the JSON body goes to the
endpoint whose request it is, judged by its shape, among the endpoints the served model
serves, in vLLM's order: chat completions (``messages``), completions (``prompt`` or
``prompt_embeds``), embeddings (``input`` or ``messages``, an embedding model), classify
(``input`` or ``messages``, a classifier), score (``text_1`` / ``text_2``, or vLLM 0.32's
``queries``, ``items``, ``data_1`` / ``data_2``), rerank (``query`` / ``documents``). The body is answered exactly as that endpoint's own route answers it,
refusals included.

vLLM tries each endpoint's request model in that order and takes the first that accepts the
body; a well-formed body goes to the same endpoint here, but a malformed one gets the
endpoint's own 400 naming the field (vLLM's answer for it would be another endpoint's, or
"cannot find a handler").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)


class Invocation(NamedTuple):
    """One endpoint /invocations can route to."""

    request_type: type[BaseModel]
    handler: str  # the app.state attribute of the serving handler
    method: str  # its coroutine method taking (request, raw)
    endpoint: str  # the endpoint's own route, for messages
    keys: tuple[str, ...]  # the body keys that mark its request
    served: Callable[[Any], bool]  # whether the handler serves the model's task


def _scores(handler: Any) -> bool:
    return handler.engine.task == "embed" or handler.serves("score")


INVOCATIONS = (  # vLLM's order: the first whose keys the body has wins
    Invocation(ChatCompletionRequest, "chat", "create_chat_completion",
               "/v1/chat/completions", ("messages",), lambda h: h.serves("generate")),
    Invocation(CompletionRequest, "completion", "create_completion", "/v1/completions",
               ("prompt", "prompt_embeds"), lambda h: h.serves("generate")),
    Invocation(EmbeddingRequest, "embedding", "create_embedding", "/v1/embeddings",
               ("input", "messages"), lambda h: h.serves("embed")),
    Invocation(ClassificationRequest, "classify", "create_classify", "/v1/classify",
               ("input", "messages"), lambda h: h.serves("classify")),
    Invocation(ScoreRequest, "score", "create_score", "/v1/score",  # vLLM 0.32's names too
               ("text_1", "text_2", "queries", "items", "data_1", "data_2"), _scores),
    Invocation(RerankRequest, "score", "create_rerank", "/v1/rerank", ("query", "documents"),
               _scores))


def add_invocations_route(app: FastAPI) -> None:
    """POST /invocations (needs the API key when one is set)."""
    @app.post("/invocations")
    async def invocations(raw: Request, body: dict[str, Any] = Body(...)) -> Response:  # noqa: B008
        """Answer ``body`` as the endpoint of the first ``INVOCATIONS`` entry the served model
        serves and one of whose marking keys the body has.

        Raises:
            RequestValidationError: (a 400 naming the field, as that endpoint's) for a body
                its request model refuses.
            OpenAIError: 400 (code ``invalid_value``) for a body with none of the served
                endpoints' keys; whatever the chosen endpoint raises.
        """
        served = [inv for inv in INVOCATIONS if inv.served(getattr(raw.app.state, inv.handler))]
        for inv in served:
            if any(key in body for key in inv.keys):
                try:
                    request = inv.request_type.model_validate(body)
                except ValidationError as e:
                    raise RequestValidationError(e.errors()) from None
                handler = getattr(raw.app.state, inv.handler)
                return await getattr(handler, inv.method)(request, raw)
        raise OpenAIError(
            "/invocations cannot tell which endpoint this body is for: it has none of the "
            "fields that mark a request of the endpoints this model serves ("
            + "; ".join(f"{' or '.join(inv.keys)} for {inv.endpoint}" for inv in served)
            + ")", param=None, code="invalid_value")
