"""vLLM's profiling routes, on the app only when the server runs with
``KVFLOW_TORCH_PROFILER_DIR`` set (``kvflow.config.profiler``):

``POST /start_profile``  start the torch profiler on every rank; 200
``POST /stop_profile``   stop it and write one Chrome trace per rank into that folder;
                         200 ``{"traces": [path, ...]}``

Starting twice, or stopping what was not started, is a 400 with an OpenAI error body.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvflow.config.profiler import PROFILER_DIR_VARIABLE
from kvflow.engine.streams import EngineDeadError
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead
from kvflow.entrypoints.ops_routes import add_disabled_route


def add_profile_routes(app: FastAPI, enabled: bool) -> None:
    """/start_profile and /stop_profile when ``enabled`` (profiling on), else a 404 at each
    naming the variable."""
    if not enabled:
        for path in ("/start_profile", "/stop_profile"):
            add_disabled_route(app, "POST", path, f"{PROFILER_DIR_VARIABLE} set")
        return

    @app.post("/start_profile")
    async def start_profile(raw: Request) -> Response:
        """Raises OpenAIError: 400 while a profile runs; 503 if the engine is gone."""
        await _call(raw.app.state.engine.start_profile())
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile(raw: Request) -> JSONResponse:
        """Raises OpenAIError: 400 when no profile runs; 503 if the engine is gone."""
        return JSONResponse({"traces": await _call(raw.app.state.engine.stop_profile())})


T = TypeVar("T")


async def _call(call: Awaitable[T]) -> T:
    """Await an engine call; its ValueError is a 400 (code ``invalid_state``)."""
    try:
        return await call
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ValueError as e:
        raise OpenAIError(str(e), code="invalid_state") from None
