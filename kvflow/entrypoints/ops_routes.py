"""The operational routes vLLM's server has beside the OpenAI API: /ping (SageMaker's health
check, answered as /health), GET /load (``--enable-server-load-tracking``),
GET /tokenizer_info (``--enable-tokenizer-info-endpoint``), and, with
``KVFLOW_SERVER_DEV_MODE=1``, POST /reset_prefix_cache and GET /server_info. Off, each of the
optional ones answers 404 naming what turns it on."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvflow import __version__
from kvflow.engine.async_llm import EngineDeadError
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead


def add_ops_routes(app: FastAPI, health: Callable[[Request], Awaitable[Response]]) -> None:
    """/ping (GET and POST: ``health``'s answer), /load, /tokenizer_info and the development
    routes, by ``app.state.config``."""
    config = app.state.config
    for method in ("GET", "POST"):  # one route each: an OpenAPI operation id each
        app.add_api_route("/ping", health, methods=[method])
    _optional(app, "GET", "/load", _load, config.enable_server_load_tracking,
              "--enable-server-load-tracking")
    _optional(app, "GET", "/tokenizer_info", _tokenizer_info,
              config.enable_tokenizer_info_endpoint, "--enable-tokenizer-info-endpoint")
    _optional(app, "POST", "/reset_prefix_cache", _reset_prefix_cache, config.dev_mode,
              "KVFLOW_SERVER_DEV_MODE=1")
    _optional(app, "GET", "/server_info", _server_info, config.dev_mode,
              "KVFLOW_SERVER_DEV_MODE=1")


def _optional(app: FastAPI, method: str, path: str, route: Callable[[Request], Awaitable[Any]],
              enabled: bool, switch: str) -> None:
    """``route`` at ``path`` if ``enabled``, else a 404 naming ``switch`` (left out of the
    OpenAPI schema)."""
    if enabled:
        app.add_api_route(path, route, methods=[method])
    else:
        add_disabled_route(app, method, path, switch)


def add_disabled_route(app: FastAPI, method: str, path: str, switch: str) -> None:
    """A 404 at ``path`` naming the ``switch`` that serves it (left out of the OpenAPI
    schema), for a route that is off."""

    async def off() -> Response:
        """Raises OpenAIError: 404 (code ``endpoint_disabled``) naming the switch."""
        raise OpenAIError(f"{method} {path} is served only with {switch}", 404,
                          "not_found_error", code="endpoint_disabled")

    app.add_api_route(path, off, methods=[method], include_in_schema=False)


async def engine_call(raw: Request, param: str | None, call: Any) -> Any:
    """Await ``call(engine)`` for a development route.

    Raises:
        OpenAIError: 400 (code ``invalid_value``, naming ``param``) for the engine's
            ValueError; 503 if the engine is gone.
    """
    try:
        return await call(raw.app.state.engine)
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ValueError as e:
        raise OpenAIError(str(e), param=param, code="invalid_value") from None


async def _load(raw: Request) -> JSONResponse:
    """``{"server_load": N}``: the requests being served now (``server_load.ServerLoad``)."""
    return JSONResponse({"server_load": raw.app.state.server_load.value})


async def _tokenizer_info(raw: Request) -> JSONResponse:
    """The tokenizer's configuration as vLLM gives it: its ``init_kwargs`` (file paths left
    out, special tokens as their text), ``tokenizer_class`` and the ``chat_template`` the
    server renders conversations with (``--chat-template``'s, else the tokenizer's; left out
    when there is none).

    Raises:
        OpenAIError: 404 when the server loaded no tokenizer (``--skip-tokenizer-init``).
    """
    tokenizer = raw.app.state.engine.tokenizer
    if tokenizer is None:
        raise OpenAIError("this server loaded no tokenizer (--skip-tokenizer-init)", 404,
                          "not_found_error", code="no_tokenizer")
    info = {key: _jsonable(value) for key, value in (tokenizer.init_kwargs or {}).items()
            if key not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = raw.app.state.chat.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return JSONResponse(info)


async def _reset_prefix_cache(raw: Request) -> JSONResponse:
    """Forget every cached prefix (``AsyncLLM.reset_prefix_cache``): 200
    ``{"success": true}`` (vLLM 0.32's body).

    Raises:
        OpenAIError: 400 for a query parameter or a body (it takes neither); 409 (code
            ``engine_busy``)
            while requests are being served (nothing changed; running requests are never
            touched: retry once they finished); 503 if the engine is gone.
    """
    if raw.query_params:
        name = next(iter(raw.query_params))
        raise OpenAIError(f"POST /reset_prefix_cache takes no parameters (got {name!r})",
                          param=name, code="unknown_parameter")
    if (await raw.body()).strip() not in (b"", b"{}"):
        raise OpenAIError("POST /reset_prefix_cache takes no body", code="unsupported_parameter")
    try:
        reset = await raw.app.state.engine.reset_prefix_cache()
    except EngineDeadError as e:
        raise engine_dead(e) from None
    if not reset:
        raise OpenAIError("the prefix cache can be reset only while no request is being "
                          "served (their blocks would keep serving prefix hits); nothing "
                          "was changed: retry once they finished", 409,
                          "invalid_request_error", code="engine_busy")
    return JSONResponse({"success": True})


async def _server_info(raw: Request) -> JSONResponse:
    """kvflow's version, the served model's name, and the engine's and the server's
    configurations (every setting, the API key and a ``--hf-token`` token masked) as JSON."""
    state = raw.app.state
    server = _jsonable(state.config)
    if server.get("api_key") is not None:
        server["api_key"] = "***"
    engine = _jsonable(state.engine.config)
    model = engine.get("model_config") or {}
    if isinstance(model.get("hf_token"), str):  # --hf-token TOKEN (True, the stored one, shows)
        model["hf_token"] = "***"
    return JSONResponse({"version": __version__, "model": state.model_name,
                         "engine_config": engine, "server_config": server})


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data: dataclasses as objects of their fields, enums as their values,
    special tokens (``AddedToken``) as their text, other objects as ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)
