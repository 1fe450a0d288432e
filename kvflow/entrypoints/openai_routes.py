"""The OpenAI-compatible routes (completions, chat, embeddings, pooling, score, rerank,
classify, models), the LoRA load/unload routes (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
only) and the status routes (/health, /version, /metrics), each a thin call into the handler
kept on ``app.state`` (``api_server.build_app`` creates them)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvflow import __version__
from kvflow.engine.async_llm import EngineDeadError, EngineShutdownError
from kvflow.entrypoints.http_guards import error_response
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead
from kvflow.entrypoints.ops_routes import add_disabled_route
from kvflow.entrypoints.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from kvflow.entrypoints.responses_routes import add_responses_routes
from kvflow.entrypoints.serving_models import ModelNotFound
from kvflow.lora.request import LoRANameError
from kvflow.metrics.server import CONTENT_TYPE

logger = logging.getLogger(__name__)
LORA_ROUTES_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"

def add_openai_routes(app: FastAPI) -> None:
    """The OpenAI routes and /v1/responses' on ``app`` (the LoRA routes:
    :func:`add_lora_routes`), in this order."""
    _add_generation_routes(app)
    _add_pooling_routes(app)
    _add_model_routes(app)


def _add_generation_routes(app: FastAPI) -> None:
    """/v1/completions, /v1/chat/completions and the /v1/responses routes."""

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await raw.app.state.completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await raw.app.state.chat.create_chat_completion(req, raw)

    add_responses_routes(app)


def _add_pooling_routes(app: FastAPI) -> None:
    """The pooling models' routes: embeddings, pooling, score, rerank, classify."""

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await raw.app.state.embedding.create_embedding(req, raw)

    @app.post("/pooling")
    async def pooling(req: PoolingRequest, raw: Request) -> Response:
        return await raw.app.state.pooling.create_pooling(req, raw)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(req: ScoreRequest, raw: Request) -> Response:
        return await raw.app.state.score.create_score(req, raw)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest, raw: Request) -> Response:
        return await raw.app.state.score.create_rerank(req, raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(req: ClassificationRequest, raw: Request) -> Response:
        return await raw.app.state.classify.create_classify(req, raw)


def _add_model_routes(app: FastAPI) -> None:
    """/v1/models and OpenAI's retrieve-model, /v1/models/{model}."""

    @app.get("/v1/models")
    async def models(raw: Request) -> ModelList:
        return ModelList(data=_model_cards(raw))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, raw: Request) -> ModelCard:
        """OpenAI's retrieve-model: the card of the base model or a LoRA adapter.

        Raises:
            OpenAIError: 404 (``model_not_found``) for a name this server does not serve.
        """
        cards = _model_cards(raw)
        for card in cards:
            if card.id == model:
                return card
        raise OpenAIError(f"the model {model!r} does not exist; this server serves "
                          f"{[c.id for c in cards]}", 404, "invalid_request_error", "model",
                          "model_not_found")


def add_lora_routes(app: FastAPI, enabled: bool) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on ``app`` when ``enabled``
    (``ServerConfig.allow_runtime_lora_updating``: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``),
    with vLLM's start-up warning; else each is a 404 naming the switch, left out of the
    OpenAPI schema (vLLM leaves them off its app). Adapters given with ``--lora-modules``
    are served either way."""
    if not enabled:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            add_disabled_route(app, "POST", path, LORA_ROUTES_SWITCH)
        return
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server "
                   "(VLLM_ALLOW_RUNTIME_LORA_UPDATING): any client holding the API key can "
                   "make it read adapter files from any path it can read. This should ONLY "
                   "be used for local development!")

    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])


async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> Response:
    """Serve a PEFT folder as model ``lora_name`` (vLLM's endpoint); ``load_inplace``
    replaces an adapter served under that name.

    Raises:
        OpenAIError: 400 for a name in use (without ``load_inplace``), one of the
            served model's names, empty, whitespace only or holding a control
            character (``param`` ``lora_name``), or an adapter the
            engine refuses (rank above --max-lora-rank, target modules kvflow cannot
            adapt, no --enable-lora) or a field kvflow does not declare.
    """
    raw.app.state.unknown_fields.check(req, "/v1/load_lora_adapter")
    try:
        await raw.app.state.models.load(req.lora_name, req.lora_path, req.load_inplace)
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ValueError as e:
        param = "lora_name" if isinstance(e, LoRANameError) or \
            "already been loaded" in str(e) else "lora_path"
        raise OpenAIError(str(e), param=param, code="invalid_value") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                    media_type="text/plain")


async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request) -> Response:
    """Stop serving adapter ``lora_name`` (vLLM's endpoint).

    Raises:
        OpenAIError: 404 when no adapter of that name is loaded; 400 for a field kvflow
            does not declare.
    """
    raw.app.state.unknown_fields.check(req, "/v1/unload_lora_adapter")
    try:
        await raw.app.state.models.unload(req.lora_name)
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ModelNotFound as e:
        raise OpenAIError(str(e), 404, "not_found_error", "lora_name",
                          "model_not_found") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                    media_type="text/plain")


async def health(raw: Request) -> Response:
    """/health (and /ping): 200 with no body while the engine runs, else 503."""
    engine = raw.app.state.engine
    if engine.is_healthy:
        return Response(status_code=200)
    if isinstance(engine.dead_error, EngineShutdownError):
        return error_response(engine_dead(engine.dead_error))
    return error_response(OpenAIError("the engine core is not running", 503,
                                       "service_unavailable", code="engine_dead"))


def add_status_routes(app: FastAPI) -> None:
    """The open routes: /health, /version, /metrics (/ping and /load: ``ops_routes``)."""
    app.add_api_route("/health", health, methods=["GET"])

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        return Response(raw.app.state.engine.metrics.render(), media_type=CONTENT_TYPE)


def _model_cards(raw: Request) -> list[ModelCard]:
    """/v1/models' cards: the base model, then each LoRA adapter."""
    state = raw.app.state
    return state.models.cards(state.engine.max_model_len, state.engine.config.model_config.model)
