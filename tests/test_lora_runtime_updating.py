"""Runtime LoRA updating behind vLLM's opt-in (kvflow/config/runtime_lora.py): POST
/v1/load_lora_adapter and /v1/unload_lora_adapter are served only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (or ``KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1``), as in
vLLM (vllm/entrypoints/serve/lora/api_router.py attaches them only then, with a warning).
Off (the default), any API-key holder could otherwise make the server read adapter files
from any path: each route is a 404 naming the switch, out of the OpenAPI schema, and nothing
reaches the engine, while ``--lora-modules`` adapters are still served. On ``build_app``
over a stand-in engine (FastAPI's TestClient); the served routes against the tiny Llama and
peft: tests/e2e/test_openai_lora.py."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvflow.config import EngineConfig, LoRAConfig, ServerConfig
from kvflow.config.runtime_lora import runtime_lora_updating
from kvflow.entrypoints.cli import build_parser

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
VLLM, KVFLOW = "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"


class _Engine(SimpleNamespace):
    """What ``build_app`` / ``start_app`` and the LoRA routes read of an AsyncLLM; records
    the adapters loaded and removed."""

    def __init__(self) -> None:
        super().__init__(config=EngineConfig(lora_config=LoRAConfig(enable_lora=True)),
                         is_healthy=True, dead_error=None, task="generate",
                         processor=SimpleNamespace(pooler=None), max_model_len=64,
                         added=[], removed=[])

    async def start(self) -> None:
        pass

    async def add_lora(self, lora) -> None:
        self.added.append((lora.lora_name, lora.lora_path))

    async def remove_lora(self, lora_int_id: int) -> None:
        self.removed.append(lora_int_id)


def _config(*argv: str, env: dict[str, str] | None = None) -> ServerConfig:
    return ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]), env=env or {})


def _client(config: ServerConfig) -> tuple[TestClient, _Engine]:
    """A TestClient over ``build_app``, its ``--lora-modules`` loaded as ``start_app`` does."""
    from kvflow.entrypoints.api_server import build_app, start_app

    engine = _Engine()
    app = build_app(engine, config, "m")
    asyncio.run(start_app(app))
    return TestClient(app), engine


@pytest.mark.parametrize("env, on", [
    ({}, False), ({VLLM: "0"}, False), ({VLLM: ""}, False), ({VLLM: "false"}, False),
    ({VLLM: "1"}, True), ({VLLM: "true"}, True), ({VLLM: " True "}, True),
    ({KVFLOW: "1"}, True), ({KVFLOW: "0"}, False), ({VLLM: "1", KVFLOW: "true"}, True),
])
def test_the_switch_reads_as_vllm_reads_it(env, on):
    """vLLM's rule (vllm/envs.py): ``1`` or ``true`` in any case, blanks stripped; off by
    default."""
    assert runtime_lora_updating(env) is on
    assert _config(env=env).allow_runtime_lora_updating is on


@pytest.mark.parametrize("env, named", [
    ({VLLM: "yes"}, f"{VLLM}='yes'"), ({KVFLOW: "2"}, f"{KVFLOW}='2'"),
    ({VLLM: "1", KVFLOW: "0"}, f"{VLLM}='1' and {KVFLOW}='0' disagree"),
])
def test_a_value_of_neither_kind_is_refused_naming_the_variable(env, named):
    with pytest.raises(ValueError, match=named):
        runtime_lora_updating(env)
    with pytest.raises(ValueError, match=named):
        _config(env=env)


def test_off_by_default_each_route_is_a_404_naming_the_switch(tmp_path):
    client, engine = _client(_config("--enable-lora"))
    bodies = {LOAD: {"lora_name": "x", "lora_path": str(tmp_path)}, UNLOAD: {"lora_name": "x"}}
    for path, body in bodies.items():
        resp = client.post(path, json=body)
        assert resp.status_code == 404, resp.text
        assert resp.json() == {"error": {
            "message": f"POST {path} is served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
            "type": "not_found_error", "param": None, "code": "endpoint_disabled"}}
    assert engine.added == [] and engine.removed == []
    assert not {LOAD, UNLOAD} & set(client.get("/openapi.json").json()["paths"])


def test_off_the_start_up_adapters_are_still_served():
    client, engine = _client(_config("--enable-lora", "--lora-modules", "sql=/adapters/sql"))
    assert engine.added == [("sql", "/adapters/sql")]
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("m", engine.config.model_config.model),
                                                     ("sql", "/adapters/sql")]
    assert client.app.state.models.resolve("sql").lora_path == "/adapters/sql"
    assert client.post(UNLOAD, json={"lora_name": "sql"}).status_code == 404
    assert client.app.state.models.resolve("sql").lora_path == "/adapters/sql"  # still served


@pytest.mark.parametrize("variable", [VLLM, KVFLOW])
def test_on_the_routes_load_and_unload_with_vllms_warning(variable, caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.openai_routes"):
        client, engine = _client(_config("--enable-lora", env={variable: "1"}))
    assert "LoRA dynamic loading & unloading is enabled in the API server" in caplog.text
    assert "ONLY be used for local development" in caplog.text
    assert {LOAD, UNLOAD} <= set(client.get("/openapi.json").json()["paths"])
    resp = client.post(LOAD, json={"lora_name": "math", "lora_path": "/adapters/math"})
    assert (resp.status_code, resp.text) == \
        (200, "Success: LoRA adapter 'math' added successfully.")
    assert engine.added == [("math", "/adapters/math")]
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["m", "math"]
    resp = client.post(UNLOAD, json={"lora_name": "math"})
    assert (resp.status_code, resp.text) == \
        (200, "Success: LoRA adapter 'math' removed successfully.")
    assert len(engine.removed) == 1
    # still a JSON route: a body of another type is refused naming it
    resp = client.post(LOAD, content=b'{"lora_name": "a", "lora_path": "/p"}',
                       headers={"Content-Type": "text/plain"})
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "unsupported_media_type")


def test_off_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.openai_routes"):
        _client(_config("--enable-lora"))
    assert "LoRA dynamic loading" not in caplog.text
