"""vLLM's profiling routes, on the app only when the server runs with
``KVFLOW_TORCH_PROFILER_DIR`` set (``kvflow.config.profiler``):

``POST /start_profile``  start the torch profiler on every rank; 200
``POST /stop_profile``   stop it and write one Chrome trace per rank into that folder;
                         200 ``{"traces": [path, ...]}``

Starting twice, or stopping what was not started, is a 400 (code ``invalid_value``) with an
OpenAI error body.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvflow.config.profiler import PROFILER_DIR_VARIABLE
from kvflow.entrypoints.ops_routes import add_disabled_route, engine_call


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
        await engine_call(raw, None, lambda e: e.start_profile())
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile(raw: Request) -> JSONResponse:
        """Raises OpenAIError: 400 when no profile runs; 503 if the engine is gone."""
        return JSONResponse({"traces": await engine_call(raw, None, lambda e: e.stop_profile())})
