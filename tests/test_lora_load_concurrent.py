"""Loading LoRA adapters by name while another load of that name is still running
(kvflow/entrypoints/serving_models.py). The documented contract (README, "LoRA adapters"):
loading a name in use is refused unless ``load_inplace`` asks to replace it. The engine is a
stand-in whose ``add_lora`` waits until the test lets it finish, so the overlap is certain.
The same stand-in serves the checks of names no adapter can have (empty, whitespace only, a
control character such as NUL), on the load route and in a request's ``model``."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.entrypoints.serving_models import ServingModels


class _SlowEngine:
    """``add_lora`` returns once ``release`` is set; records added and removed ids."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.added: list[int] = []
        self.removed: list[int] = []

    async def add_lora(self, lora) -> None:
        await self.release.wait()
        self.added.append(lora.lora_int_id)

    async def remove_lora(self, lora_int_id: int) -> None:
        self.removed.append(lora_int_id)


async def _two_loads(replace: bool) -> tuple[list, ServingModels, _SlowEngine]:
    engine = _SlowEngine()
    models = ServingModels(engine, "base")
    first = asyncio.ensure_future(models.load("sql", "/adapters/a"))
    await asyncio.sleep(0)  # the first load is now waiting in the engine
    second = asyncio.ensure_future(models.load("sql", "/adapters/b", replace=replace))
    await asyncio.sleep(0)
    engine.release.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    return results, models, engine


def test_second_load_of_a_name_being_loaded_is_refused():
    """Both loads answered success (HTTP 200) and the second silently replaced the first,
    as load_inplace would; the second must be refused, the first served."""
    (first, second), models, engine = asyncio.run(_two_loads(replace=False))
    assert first.lora_path == "/adapters/a"
    assert isinstance(second, ValueError) and "'sql' has already been loaded" in str(second)
    assert models.resolve("sql").lora_path == "/adapters/a"
    assert engine.added == [first.lora_int_id] and engine.removed == []


def test_load_inplace_during_a_load_replaces_it():
    (first, second), models, engine = asyncio.run(_two_loads(replace=True))
    assert models.resolve("sql") is second and second.lora_path == "/adapters/b"
    assert engine.removed == [first.lora_int_id]  # the replaced adapter leaves the engine


def test_a_refused_load_frees_the_name():
    engine = _SlowEngine()
    models = ServingModels(engine, "base")

    async def refuse(lora) -> None:
        raise ValueError("rank 64 exceeds max_lora_rank=16")

    engine.add_lora = refuse
    with pytest.raises(ValueError, match="rank 64"):
        asyncio.run(models.load("sql", "/adapters/wide"))
    engine.release.set()
    engine.add_lora = _SlowEngine.add_lora.__get__(engine)
    assert asyncio.run(models.load("sql", "/adapters/a")).lora_path == "/adapters/a"


BAD_NAMES = [("", "is empty"), ("   ", "is whitespace only"), ("\t\n", "is whitespace only"),
             ("sql\x00", "holds the control character U+0000"),
             ("a\x7fb", "holds the control character U+007F")]


@pytest.mark.parametrize("name,why", BAD_NAMES)
def test_a_name_no_adapter_can_have_is_refused(name, why):
    """Such a name was loaded and served (HTTP 200 on the load route, then as ``model``);
    now a ValueError naming the field and why, offline (LoRARequest) as on the server, and
    nothing reaches the engine."""
    from kvflow.lora.request import LoRANameError, LoRARequest

    engine = _SlowEngine()
    engine.release.set()
    models = ServingModels(engine, "base")
    with pytest.raises(LoRANameError) as e:
        asyncio.run(models.load(name, "/adapters/a"))
    assert str(e.value).startswith(f"lora_name {name!r} {why}")
    assert engine.added == [] and models.names() == ["base"]
    with pytest.raises(LoRANameError) as e:
        LoRARequest(name, 1, "/adapters/a")
    assert why in str(e.value)
    with pytest.raises(LoRANameError) as e:
        models.resolve(name)
    assert str(e.value).startswith(f"model {name!r} {why}")


def test_names_with_inner_spaces_and_other_scripts_still_load():
    engine = _SlowEngine()
    engine.release.set()
    models = ServingModels(engine, "base")
    for name in ("my adapter", "sql-v2", "数据"):
        assert asyncio.run(models.load(name, "/adapters/a")).lora_name == name
        assert models.resolve(name).lora_name == name


def test_the_load_route_and_model_lookups_answer_400_naming_the_field():
    """Over HTTP: kvflow's load route and its ``model`` check (the server's own code, a
    stand-in engine behind it) answer OpenAI's 400 with ``param`` the field."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvflow.entrypoints.http_guards import add_error_handlers
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.openai_routes import add_lora_routes
    from kvflow.entrypoints.serving_base import OpenAIServing

    engine = _SlowEngine()
    engine.release.set()
    app = FastAPI()
    add_error_handlers(app)
    add_lora_routes(app, enabled=True)  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    app.state.models = ServingModels(engine, "base")
    app.state.unknown_fields = SimpleNamespace(check=lambda req, endpoint: None)
    client = TestClient(app)
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "sql\u0000",
                                                       "lora_path": "/adapters/a"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("lora_name", "invalid_value"), error
    assert "U+0000" in error["message"] and engine.added == []
    ok = client.post("/v1/load_lora_adapter", json={"lora_name": "sql",
                                                     "lora_path": "/adapters/a"})
    assert ok.status_code == 200, ok.text
    serving = SimpleNamespace(models=app.state.models)
    with pytest.raises(OpenAIError) as e:
        OpenAIServing.check_model(serving, " ")
    assert (e.value.status, e.value.param, e.value.code) == (400, "model", "invalid_value")
    assert OpenAIServing.check_model(serving, "sql").lora_path == "/adapters/a"


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("name", ["base", "alias"])
def test_a_served_model_name_is_refused_as_the_served_model(name, replace):
    """``lora_name`` equal to one of the base model's served names (``--served-model-name
    base alias``) was refused as "the LoRA adapter 'alias' has already been loaded", naming
    an adapter that does not exist (/v1/models lists none, unloading it is a 404); the
    refusal now says it is the served model's name, as ``--lora-modules`` does at start-up
    (preload_checks.check_lora_modules); over HTTP its ``param`` is ``lora_name`` (the route
    named ``lora_path`` for any message but "already been loaded"). Nothing reaches the
    engine, with or without ``load_inplace``."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvflow.entrypoints.http_guards import add_error_handlers
    from kvflow.entrypoints.openai_routes import add_lora_routes
    from kvflow.lora.request import LoRANameError

    engine = _SlowEngine()
    engine.release.set()
    models = ServingModels(engine, "base", aliases=("alias",))
    expected = (f"lora_name {name!r} is a name of the served model "
                "(--served-model-name): give the adapter another name")
    with pytest.raises(LoRANameError) as e:
        asyncio.run(models.load(name, "/adapters/a", replace=replace))
    assert str(e.value) == expected
    app = FastAPI()
    add_error_handlers(app)
    add_lora_routes(app, enabled=True)  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    app.state.models = models
    app.state.unknown_fields = SimpleNamespace(check=lambda req, endpoint: None)
    resp = TestClient(app).post("/v1/load_lora_adapter", json={
        "lora_name": name, "lora_path": "/adapters/a", "load_inplace": replace})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["message"], error["param"], error["code"]) == (
        expected, "lora_name", "invalid_value"), error
    assert engine.added == [] and models.names() == ["base", "alias"]
    assert models.resolve(name) is None  # still the base model
