"""The OpenAI-compatible HTTP server: a FastAPI app built by ``build_app`` over one AsyncLLM.

Routes: /v1/completions, /v1/chat/completions, /v1/responses (+ GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel:
``responses_routes``),
/v1/embeddings, /pooling, /v1/score (and /score), /v1/rerank (and /rerank, /v2/rerank),
/classify (and /v1/classify),
/v1/models[/{model}],
/v1/load_lora_adapter, /v1/unload_lora_adapter (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
only), /tokenize, /detokenize, /invocations
(``invocations``), /tokenizer_info and the development routes (``ops_routes``) (these need
the API key when one is set), and /health, /ping, /load, /metrics, /version (always open).
Every error is
an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``); malformed input is
a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI

from kvflow import __version__
from kvflow.chat.template import check_default_template_kwargs
from kvflow.chat_template_source import load_chat_template, warn_if_model_template_broken
from kvflow.config import EngineConfig, ServerConfig
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.start_method import core_start_method
from kvflow.entrypoints.body_limit import BodySizeLimitMiddleware
from kvflow.entrypoints.http_guards import (
    ApiKeyMiddleware,
    add_error_handlers,
    require_json_body,
)
from kvflow.entrypoints.http_options import (
    add_http_middleware,
    check_ssl_files,
    fastapi_options,
    uvicorn_options,
)
from kvflow.entrypoints.invocations import add_invocations_route
from kvflow.entrypoints.openai_routes import (
    add_lora_routes,
    add_openai_routes,
    add_status_routes,
    health,
)
from kvflow.entrypoints.ops_routes import add_ops_routes
from kvflow.entrypoints.preload_checks import (
    check_listen_address,
    check_lora_modules,
    check_socket_path,
)
from kvflow.entrypoints.profile_routes import add_profile_routes
from kvflow.entrypoints.responses_store import ResponseStore
from kvflow.entrypoints.server_load import ServerLoad, ServerLoadMiddleware
from kvflow.entrypoints.server_shutdown import AbortingServer, sigterm_stops_loading
from kvflow.entrypoints.serving_chat import OpenAIServingChat
from kvflow.entrypoints.serving_classification import OpenAIServingClassification
from kvflow.entrypoints.serving_completion import OpenAIServingCompletion
from kvflow.entrypoints.serving_embedding import OpenAIServingEmbedding
from kvflow.entrypoints.serving_models import ServingModels
from kvflow.entrypoints.serving_pooling import OpenAIServingPooling
from kvflow.entrypoints.serving_responses import OpenAIServingResponses
from kvflow.entrypoints.serving_score import OpenAIServingScore
from kvflow.entrypoints.sleep_routes import add_sleep_routes
from kvflow.entrypoints.token_routes import add_token_routes
from kvflow.entrypoints.unknown_fields import UnknownFields
from kvflow.metrics.server import ServerMetrics
from kvflow.runtime.gc_heap import freeze_startup_heap, unfreeze_heap

logger = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """uvicorn's lifespan: shut the engine down once the server stops (``start_app`` started
    it before the lifespan's start-up); background responses still running are cancelled
    first."""
    yield
    await app.state.responses.shutdown()
    await app.state.engine.shutdown()


async def start_app(app: FastAPI) -> None:
    """Start the engine's output loop, then load the adapters of ``--lora-modules NAME=PATH
    ...``; ``_StartingServer`` runs it before uvicorn's start-up, so a refused adapter leaves
    ``uvicorn.Server.run`` as itself. Raised in the lifespan, starlette had logged it as a
    20-line traceback and uvicorn had ended the process with exit status 3. ``kvflow
    run-batch`` (``run_batch.run_batch``) runs it before its first line, as it has no
    lifespan.

    Raises:
        ValueError: for an adapter the engine refuses, naming the flag (the engine is shut
            down first; the server does not start).
    """
    engine: AsyncLLM = app.state.engine
    engine.on_dead = lambda error: _on_engine_dead(app, error)
    await engine.start()
    for spec in app.state.config.lora_modules or []:
        name, _, path = spec.partition("=")
        try:
            await app.state.models.load(name, path)
        except ValueError as e:
            await engine.shutdown()
            raise ValueError(f"--lora-modules {spec}: {e}") from None
        logger.info("serving LoRA adapter %s from %s", name, path)


class _StartingServer(AbortingServer):
    """``AbortingServer`` that runs ``start_app`` before uvicorn's own start-up (the
    lifespan, then the listening socket)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config, app.state.engine, app.state.config.shutdown_timeout)
        self.app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await start_app(self.app)
        await super().startup(sockets)


def _on_engine_dead(app: FastAPI, error: BaseException) -> None:
    """A core process (a data-parallel replica's) died: exit the server (``--engine-failure
    exit``, the default; the exit status is 1) or start a new core for it in the background
    (``restart``; the other replicas keep serving). Once the server is shutting down (a
    signal), a core's end is part of it: logged at INFO, neither restarted nor an error (the
    server ends as the signal says)."""
    config: ServerConfig = app.state.config
    if app.state.engine.is_stopping:  # the core stopped with the server: a SIGTERM sent
        # to both (pkill -f, a systemd stop, kill of the process group)
        logger.info("engine core exited while the server shuts down (%s)", error)
        return
    if config.engine_failure == "restart":
        logger.error("engine core died (%s); restarting it (--engine-failure restart)", error)
        previous = getattr(app.state, "restart_task", None)
        if previous is None or previous.done():  # a running restart takes every dead core
            app.state.restart_task = asyncio.create_task(_restart_engine(app))
        return
    logger.error("engine core died (%s); shutting the server down (--engine-failure exit)",
                 error)
    app.state.engine.fail_all(error)  # other data-parallel replicas' requests end too
    _on_engine_dead_exit(app)


async def _restart_engine(app: FastAPI) -> None:
    config: ServerConfig = app.state.config
    try:
        await app.state.engine.restart(config.engine_start_timeout)
    except Exception as e:  # noqa: BLE001 - a failed restart ends the server like 'exit'
        logger.error("engine restart failed (%s); shutting the server down", e)
        _on_engine_dead_exit(app)
        return
    logger.warning("engine core restarted (pids %s); serving again",
                   [core.pid for core in app.state.engine.cores])


def _on_engine_dead_exit(app: FastAPI) -> None:
    app.state.engine_died = True
    app.state.engine.begin_shutdown()  # another replica's end is part of it now
    server = getattr(app.state, "uvicorn_server", None)
    if server is not None:
        server.should_exit = True


def build_app(engine: AsyncLLM, config: ServerConfig, model_name: str,
              chat_template: str | None = None) -> FastAPI:
    """The FastAPI app over a started-up (model loaded) AsyncLLM; its lifespan starts the
    output loop and shuts the engine down. All state lives on ``app.state``.
    ``chat_template``: ``config.chat_template``'s text as ``load_chat_template`` returned it
    (``run_server`` reads it once, before the model loads); None: read here.

    Raises:
        ValueError: for a ``config.chat_template`` that cannot be used (``OpenAIServingChat``).
    """
    app = FastAPI(title="kvflow", version=__version__, lifespan=_lifespan,
                  dependencies=[Depends(require_json_body)], **fastapi_options(config))
    app.state.engine = engine
    app.state.config = config
    app.state.engine_died = False
    _add_handlers(app, engine, config, model_name, chat_template)
    _add_request_middleware(app, config)
    add_http_middleware(app, config)  # CORS outermost: preflights before the key check
    add_error_handlers(app)
    add_openai_routes(app)
    add_lora_routes(app, config.allow_runtime_lora_updating)  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    add_status_routes(app)
    add_token_routes(app)
    add_invocations_route(app)
    add_ops_routes(app, health)
    add_sleep_routes(app, config.dev_mode)  # KVFLOW_SERVER_DEV_MODE=1 only
    add_profile_routes(app, config.profiling)  # KVFLOW_TORCH_PROFILER_DIR set only
    return app


def _add_handlers(app: FastAPI, engine: AsyncLLM, config: ServerConfig, model_name: str,
                  chat_template: str | None) -> None:
    """The endpoints' handlers on ``app.state`` (``completion``, ``chat``, ``responses``,
    ``embedding``, ``score``, ``classify``, ``pooling``), with the served models and the
    server's one UnknownFields.

    Raises:
        ValueError: for a ``config.chat_template`` that cannot be used (``OpenAIServingChat``).
    """
    app.state.model_name = model_name
    app.state.models = models = ServingModels(
        engine, model_name, enable_lora=engine.config.lora_config.enable_lora,
        aliases=config.model_names(model_name)[1:])
    # one for the whole server: under --ignore-unknown-fields each name is logged once
    app.state.unknown_fields = unknown = UnknownFields(config.ignore_unknown_fields)
    app.state.completion = OpenAIServingCompletion(engine, config, model_name, models, unknown)
    app.state.chat = OpenAIServingChat(engine, config, model_name, models, unknown,
                                       chat_template)
    app.state.responses = OpenAIServingResponses(
        app.state.chat, ResponseStore(config.responses_store_size))
    app.state.embedding = OpenAIServingEmbedding(engine, config, model_name, models, unknown,
                                                 app.state.chat)
    app.state.score = OpenAIServingScore(engine, config, model_name, models, unknown)
    app.state.classify = OpenAIServingClassification(engine, config, model_name, models,
                                                     unknown, app.state.chat)
    app.state.pooling = OpenAIServingPooling(engine, config, model_name, models, unknown,
                                             app.state.chat)


def _add_request_middleware(app: FastAPI, config: ServerConfig) -> None:
    """The server-load, body-size and API-key middleware, innermost first (CORS goes on
    last, outermost: ``add_http_middleware``)."""
    app.state.server_load = ServerLoad()
    if config.enable_server_load_tracking:  # innermost: refused requests are not counted
        app.add_middleware(ServerLoadMiddleware, load=app.state.server_load)
    app.add_middleware(BodySizeLimitMiddleware, limit=config.max_request_body_bytes)
    if config.api_key:  # outermost: a request without the key is refused before its body
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_key)


def freeze_after(check_tokenizer: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """The server's ``on_tokenizer`` for ``AsyncLLM``: ``check_tokenizer`` (if any), then the
    API process's heap so far collected and frozen (``kvflow/runtime/gc_heap.py``) while the core
    processes still load the model, so that the freeze before serving walks only what was
    made since (was: all of it, 0.6-0.8 s on 2 busy cores between the engine's ready and
    ``/health``). What ``check_tokenizer`` raises is raised, nothing frozen. Logged at DEBUG:
    the freeze before serving reports the whole count (a start-up error stays the only line)."""
    def on_tokenizer(tokenizer: Any) -> None:
        if check_tokenizer is not None:
            check_tokenizer(tokenizer)
        freeze_startup_heap("API server", logging.DEBUG)
    return on_tokenizer


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               fresh_process: bool = False) -> None:
    """Load the model (engine-core process), then serve HTTP until SIGINT/SIGTERM (which
    abort the open requests first: ``server_shutdown.AbortingServer``). Without
    ``--chat-template``, a model chat template that does not compile is logged as a warning
    as soon as the tokenizer is loaded (``warn_if_model_template_broken``). ``fresh_process``:
    this process runs nothing but this server (``kvflow serve`` from the command line), so the
    engine-core processes may be forked from it (``kvflow.engine.start_method``).

    Raises:
        RuntimeError: if the engine fails to start, or died while serving (under
            ``--engine-failure exit``; the server has stopped then).
        ValueError: for a bad model or configuration, a ``--host`` / ``--port`` (or ``--uds``
            path) that cannot be listened on, a ``--chat-template`` that cannot be used (both checked before
            the model loads), or a ``--lora-modules`` adapter the engine refuses.
    """
    names = server_config.model_names(engine_config.model_config.model)
    model_name = names[0]
    _check_before_loading(engine_config, server_config, names)
    start_method = core_start_method(fresh_process)
    template = None if server_config.chat_template is None else \
        load_chat_template(server_config.chat_template)  # the one read: served as checked
    # without --chat-template, the model's template is checked once the tokenizer is loaded,
    # while the model still loads
    check_tokenizer = warn_if_model_template_broken if template is None else None
    try:
        with sigterm_stops_loading():  # as Ctrl-C does (uvicorn handles both once serving)
            engine = AsyncLLM(engine_config, ServerMetrics(model_name),
                              server_config.engine_start_timeout,
                              on_tokenizer=freeze_after(check_tokenizer),
                              start_method=start_method)
    except BaseException:
        unfreeze_heap()
        raise
    try:
        app = build_app(engine, server_config, model_name, template)
        server = _uvicorn_server(app, server_config, model_name)
        app.state.uvicorn_server = server
        freeze_startup_heap("API server")  # kvflow/runtime/gc_heap.py: no 0.2 s stalls of the streams
        server.run()
        server.end_as_signalled()
    finally:
        unfreeze_heap()  # a no-op unless frozen; for `kvflow serve` called in-process (tests)
        engine.close()
    if app.state.engine_died:
        raise RuntimeError("the engine core process died; the server stopped "
                           "(--engine-failure restart starts a new engine instead)")


def _check_before_loading(engine_config: EngineConfig, server_config: ServerConfig,
                          names: tuple[str, ...]) -> None:
    """What :func:`run_server` checks before the model loads: the address (or ``--uds``
    path) to listen on, the SSL files, ``--default-chat-template-kwargs`` and the
    ``--lora-modules`` adapters (against ``names``, the served model's).

    Raises:
        ValueError: naming the flag whose value cannot be used.
    """
    if server_config.uds is None:
        check_listen_address(server_config.host, server_config.port)
    else:
        check_socket_path(server_config.uds)
    check_ssl_files(server_config)
    check_default_template_kwargs(server_config.default_chat_template_kwargs)
    check_lora_modules(server_config.lora_modules or (), engine_config, names)


def _uvicorn_server(app: FastAPI, server_config: ServerConfig,
                    model_name: str) -> _StartingServer:
    """The uvicorn server of ``app`` with the HTTP flags (address or socket, SSL, log level,
    keep-alive), its address logged."""
    http_options = uvicorn_options(server_config)
    where = (f"unix:{server_config.uds}" if server_config.uds is not None
             else f"{server_config.host}:{server_config.port}")
    logger.info("serving %s on %s://%s%s", model_name,
                "https" if "ssl_certfile" in http_options else "http", where,
                server_config.root_path or "")
    # open requests are aborted first on SIGINT / SIGTERM (server_shutdown.py); the 5 s
    # are for other work in flight (a long /tokenize, say)
    return _StartingServer(uvicorn.Config(
        app, host=server_config.host, port=server_config.port,
        log_level=server_config.uvicorn_log_level, timeout_graceful_shutdown=5,
        timeout_keep_alive=server_config.timeout_keep_alive, **http_options), app)
