"""vLLM's operational routes on ``build_app`` over a stand-in engine (FastAPI's TestClient):
/ping answers as /health (GET and POST, healthy and not, without the API key); /load,
/tokenizer_info and the development routes answer 404 naming their switch while off;
``KVFLOW_SERVER_DEV_MODE`` parsing; /reset_prefix_cache's answers for a reset, a refusal and
a query parameter; /server_info's config (the key masked); /invocations' refusals equal the
direct endpoint's for the same bad body, and a body of no known shape is a 400 naming the
fields it could have had; /load's counter covers every generation and pooling route. The
served model's answers: tests/e2e/test_openai_ops_routes.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.cli import build_parser


def _config(*argv: str, env: dict[str, str] | None = None) -> ServerConfig:
    return ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]), env=env or {})


def _client(config: ServerConfig, **engine_fields) -> tuple[TestClient, SimpleNamespace]:
    from kvflow.entrypoints.api_server import build_app

    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True, dead_error=None,
                             task="generate", processor=SimpleNamespace(pooler=None),
                             **engine_fields)
    return TestClient(build_app(engine, config, "m")), engine


def test_ping_is_health():
    client, engine = _client(_config("--api-key", "k"))  # open, as /health
    for ping in (client.get("/ping"), client.post("/ping")):
        assert (ping.status_code, ping.content) == (200, b"")
    engine.is_healthy = False
    health = client.get("/health")
    assert health.status_code == 503
    for ping in (client.get("/ping"), client.post("/ping")):
        assert (ping.status_code, ping.json()) == (503, health.json())


@pytest.mark.parametrize("method, path, switch", [
    ("GET", "/load", "--enable-server-load-tracking"),
    ("GET", "/tokenizer_info", "--enable-tokenizer-info-endpoint"),
    ("POST", "/reset_prefix_cache", "KVFLOW_SERVER_DEV_MODE=1"),
    ("GET", "/server_info", "KVFLOW_SERVER_DEV_MODE=1"),
])
def test_off_by_default_names_the_switch(method, path, switch):
    client, _ = _client(_config())
    response = client.request(method, path)
    assert response.status_code == 404
    assert switch in response.json()["error"]["message"]
    assert path not in client.get("/openapi.json").json()["paths"]


def test_dev_mode_from_the_environment():
    assert _config().dev_mode is False
    assert _config(env={"KVFLOW_SERVER_DEV_MODE": "0"}).dev_mode is False
    assert _config(env={"KVFLOW_SERVER_DEV_MODE": "1"}).dev_mode is True
    with pytest.raises(ValueError, match="KVFLOW_SERVER_DEV_MODE='yes'"):
        _config(env={"KVFLOW_SERVER_DEV_MODE": "yes"})
    on = _config("--enable-server-load-tracking", "--enable-tokenizer-info-endpoint")
    assert on.enable_server_load_tracking and on.enable_tokenizer_info_endpoint


@pytest.mark.parametrize("reset, status", [(True, 200), (False, 409)])
def test_reset_prefix_cache_answers(reset, status):
    calls = []

    async def reset_prefix_cache():
        calls.append(1)
        return reset

    client, _ = _client(_config(env={"KVFLOW_SERVER_DEV_MODE": "1"}),
                        reset_prefix_cache=reset_prefix_cache)
    response = client.post("/reset_prefix_cache")
    assert (response.status_code, len(calls)) == (status, 1)
    if reset:  # vLLM 0.32's body (it was empty)
        assert response.json() == {"success": True}
    else:
        assert response.json()["error"]["code"] == "engine_busy"
    refused = client.post("/reset_prefix_cache?reset_running_requests=true")
    assert (refused.status_code, refused.json()["error"]["param"], len(calls)) == \
        (400, "reset_running_requests", 1)
    refused = client.post("/reset_prefix_cache", json={"reset_running_requests": True})
    assert (refused.status_code, refused.json()["error"]["code"], len(calls)) == \
        (400, "unsupported_parameter", 1)  # a body it would ignore: refused, nothing reset


def test_server_info_is_the_config_with_the_key_masked():
    config = _config("--api-key", "secret", "--port", "8123",
                     env={"KVFLOW_SERVER_DEV_MODE": "1"})
    client, engine = _client(config)
    assert client.get("/server_info").status_code == 401
    info = client.get("/server_info", headers={"Authorization": "Bearer secret"}).json()
    assert info["model"] == "m" and "secret" not in str(info)
    assert info["server_config"]["api_key"] == "***"
    assert info["server_config"]["port"] == 8123
    assert info["engine_config"]["model_config"]["model"] == engine.config.model_config.model
    assert info["engine_config"]["cache_config"]["block_size"] == \
        engine.config.cache_config.block_size


@pytest.mark.parametrize("body, path", [
    ({"prompt": 5.5, "model": "m"}, "/v1/completions"),
    ({"messages": "hi"}, "/v1/chat/completions"),
    ({"prompt": "hi", "max_tokens": "8"}, "/v1/completions"),
])
def test_invocations_refuses_as_the_endpoint_would(body, path):
    client, _ = _client(_config())
    direct, routed = client.post(path, json=body), client.post("/invocations", json=body)
    assert direct.status_code == 400
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())


def test_invocations_body_of_no_known_shape():
    client, _ = _client(_config())
    response = client.post("/invocations", json={"input": "hi"})  # embeddings: not served
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "messages for /v1/chat/completions" in message
    assert "prompt or prompt_embeds for /v1/completions" in message
    assert "/v1/embeddings" not in message
    assert client.post("/invocations", json=[1]).status_code == 400


ENGINE_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                 "/pooling", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
                 "/classify", "/v1/classify", "/invocations"]


@pytest.mark.parametrize("path, counted", [*((p, 1) for p in ENGINE_ROUTES),
                                           ("/tokenize", 0), ("/detokenize", 0)])
def test_server_load_counts_every_generation_and_pooling_route(path, counted):
    """/load counts a POST to each route README lists as generation or pooling while it
    runs (was: /pooling, /score and /v2/rerank uncounted), not /tokenize's."""
    import asyncio

    from kvflow.entrypoints.server_load import ServerLoad, ServerLoadMiddleware

    load, seen = ServerLoad(), []

    async def app(scope, receive, send):
        seen.append(load.value)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
    asyncio.run(ServerLoadMiddleware(app, load)(scope, None, None))
    assert (seen, load.value) == ([counted], 0)


@pytest.mark.parametrize("body, why", [
    (b'{"method": "reload_weights", "args": ' + b"[" * 5000 + b"]" * 5000 + b"}", "recursion"),
    (b'{"method": "reload_weights", "args": [1' + b"0" * 5000 + b"]}", "digits"),
    (b'{"method": "reload_weights"', "Expecting"),
    (b'{"method": "\xff"}', "utf-8"),
], ids=["deep", "long-int", "truncated", "not-utf8"])
def test_collective_rpc_unreadable_body_is_a_400(body, why):
    """A /collective_rpc body Python's json cannot read is a 400 (code ``invalid_json``),
    never reaching the engine: arrays nested past the recursion limit and an integer of more
    than 4,300 digits had been a 500 (RecursionError, ValueError)."""
    calls = []

    async def collective_rpc(*args):
        calls.append(args)
        return [[None]]

    client, _ = _client(_config(env={"KVFLOW_SERVER_DEV_MODE": "1"}),
                        collective_rpc=collective_rpc)
    response = client.post("/collective_rpc", content=body,
                           headers={"Content-Type": "application/json"})
    assert (response.status_code, response.json()["error"]["code"], calls) == \
        (400, "invalid_json", [])
    assert why.lower() in response.json()["error"]["message"].lower()
    ok = client.post("/collective_rpc", json={"method": "reload_weights"})
    assert (ok.status_code, ok.json()) == (200, {"results": [None]})


@pytest.mark.parametrize("method, path, status, allow", [
    ("DELETE", "/health", 405, "GET"),
    ("GET", "/v1/completions", 405, "POST"),
    ("PUT", "/v1/models", 405, "GET"),
    ("GET", "/no/such/route", 404, None),
])
def test_unrouted_requests_are_openai_errors(method, path, status, allow):
    """A method a route does not take is a 405 carrying ``Allow`` (RFC 9110, section
    15.5.6; starlette sets it, and kvflow's error handler had dropped it) and an OpenAI error
    body, as an unknown path's 404 is."""
    client, _ = _client(_config())
    response = client.request(method, path)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.headers.get("allow") == allow
    # the message names the method and path (it said only "Not Found" / "Method Not
    # Allowed"; found by the session-43 newcomer trial)
    assert response.json()["error"]["message"] == (
        f"{method} {path}: no such route" if status == 404
        else f"{method} is not allowed on {path} (it takes {allow})")
