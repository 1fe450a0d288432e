"""A kvflow OpenAI server in the test process: an ``AsyncLLM`` on a model folder behind
``build_app``, driven by starlette's ``TestClient`` (no port, no subprocess)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.testclient import TestClient


@contextmanager
def served_client(model: str, served_name: str = "m", **engine_kwargs) -> Iterator[TestClient]:
    """Yield a ``TestClient`` for the server of ``model`` (a folder) named ``served_name``;
    ``engine_kwargs`` go to ``EngineConfig.from_kwargs`` (default float32, 64 KV blocks of 4
    tokens). The engine's processes are closed on exit."""
    from kvflow.config import EngineConfig, ServerConfig
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.api_server import build_app, start_app

    kwargs = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, **engine_kwargs}
    engine = AsyncLLM(EngineConfig.from_kwargs(model=model, **kwargs))
    try:
        app = build_app(engine, ServerConfig(), served_name)
        with TestClient(app) as client:
            client.portal.call(start_app, app)
            yield client
    finally:
        engine.close()
