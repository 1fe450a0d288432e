"""Loading LoRA adapters by name while another load of that name is still running
(kvflow/entrypoints/serving_models.py). The documented contract (README, "LoRA adapters"):
loading a name in use is refused unless ``load_inplace`` asks to replace it. The engine is a
stand-in whose ``add_lora`` waits until the test lets it finish, so the overlap is certain."""

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
