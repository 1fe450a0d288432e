"""Sleep mode's HTTP routes (vLLM's development endpoints), on the app only when the server
runs with ``KVFLOW_SERVER_DEV_MODE=1`` (they free the model's memory: not for the public):

``POST /sleep?level=1``     free the KV cache, offload (1) or drop (2) the weights; 200
                            ``{"status": "sleeping", "level": 1}`` (vLLM 0.32's body)
``POST /wake_up[?tags=..]`` wake "weights" and/or "kv_cache" (repeat ``tags``; none: both); 200
                            ``{"status": "awake" | "sleeping", "tags": [...] | null}``
                            ("sleeping" while a tag still sleeps)
``GET  /is_sleeping``       ``{"is_sleeping": bool}``
``POST /collective_rpc``    ``{"method": "reload_weights", "args": [], "kwargs": {}}``: a
                            Worker method on every rank, ``{"results": [...]}`` by rank

Refusals (a bad level or tag, another query parameter, a body, requests in flight, no
``--enable-sleep-mode``) are 400s with an OpenAI error body; while asleep, generation routes answer 503 (code ``engine_sleeping``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.ops_routes import add_disabled_route, engine_call


def add_sleep_routes(app: FastAPI, dev_mode: bool) -> None:
    """/sleep, /wake_up, /is_sleeping and /collective_rpc, under dev mode only
    (``ServerConfig.dev_mode``: ``KVFLOW_SERVER_DEV_MODE=1``)."""
    if not dev_mode:  # each answers a 404 naming the switch
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/collective_rpc")):
            add_disabled_route(app, method, path, "KVFLOW_SERVER_DEV_MODE=1")
        return

    @app.post("/sleep")
    async def sleep(raw: Request) -> JSONResponse:
        """Raises OpenAIError: 400 for a level other than 1 and 2, requests in flight, or an
        engine without --enable-sleep-mode; 503 if the engine is gone."""
        await _only_params(raw, "/sleep", "level")
        text = raw.query_params.get("level", "1")
        try:
            level = int(text)
        except ValueError:
            raise OpenAIError(f"level={text!r} must be 1 or 2", param="level",
                              code="invalid_value") from None
        await engine_call(raw, "level", lambda e: e.sleep(level))
        return JSONResponse({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(raw: Request) -> JSONResponse:
        """Raises OpenAIError: 400 for an unknown tag; 503 if the engine is gone."""
        await _only_params(raw, "/wake_up", "tags")
        tags = raw.query_params.getlist("tags") or None
        awake = await engine_call(raw, "tags", lambda e: e.wake_up(tags))
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping(raw: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": raw.app.state.engine.sleep_state.is_sleeping})

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request) -> JSONResponse:
        """Raises OpenAIError: 400 for a body that is not ``{"method": str, "args": list,
        "kwargs": object}``, a method that is not a Worker's, a ``timeout`` (calls are waited
        for), or results that are not plain data; 503 if the engine is gone."""
        body = await _rpc_body(raw)
        results = await engine_call(raw, "method", lambda e: e.collective_rpc(
            body["method"], body.get("args") or [], body.get("kwargs")))
        return JSONResponse({"results": [r for replica in results for r in replica]})


async def _only_params(raw: Request, path: str, allowed: str) -> None:
    """Raises OpenAIError: 400 for a query parameter other than ``allowed`` (a misspelt
    ``levle=2`` would otherwise sleep at level 1), a repeated ``level``, or a body (the
    routes read none: ``{"level": 2}`` slept at level 1, ``{"tags": ["weights"]}`` woke
    both tags)."""
    if (await raw.body()).strip() not in (b"", b"{}"):
        raise OpenAIError(f"POST {path} takes no body: give {allowed} as a query parameter "
                          f"({path}?{allowed}=...)", param=allowed,
                          code="unsupported_parameter")
    for name in raw.query_params:
        if name != allowed:
            raise OpenAIError(f"POST {path} takes only the query parameter {allowed!r} "
                              f"(got {name!r})", param=name, code="unknown_parameter")
    if allowed == "level" and len(raw.query_params.getlist("level")) > 1:
        raise OpenAIError("level is given more than once", param="level",
                          code="invalid_value")


async def _rpc_body(raw: Request) -> dict[str, Any]:
    """The /collective_rpc body, checked.

    Raises:
        OpenAIError: 400 naming the field at fault; 400 (code ``invalid_json``) for a body
            that is not JSON, nested too deep or holding an integer too long to read.
    """
    try:
        body = json.loads(await raw.body() or b"null")
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, an integer of more
        # digits than int() reads (ValueError), arrays nested past the recursion limit
        raise OpenAIError(f"the body is not JSON kvflow can read: {e}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object with a method")
    checks = {"method": str, "args": list, "kwargs": dict}
    for field, kind in checks.items():
        value = body.get(field)
        if (value is not None or field == "method") and not isinstance(value, kind):
            raise OpenAIError(f"{field}={value!r} must be a JSON {kind.__name__}",
                              param=field, code="invalid_type")
    unknown = sorted(set(body) - {*checks, "timeout"})
    if unknown:
        raise OpenAIError(f"unknown field(s) {unknown}; /collective_rpc takes method, args, "
                          "kwargs", param=unknown[0], code="unknown_parameter")
    if body.get("timeout") is not None:
        raise OpenAIError("timeout is not supported: the call is waited for; leave it out",
                          param="timeout", code="unsupported_value")
    return body
