"""The torch profiler (vLLM's ``start_profile`` / ``stop_profile``), on with
``KVFLOW_TORCH_PROFILER_DIR``: offline ``LLM`` and ``AsyncLLM`` (its core in a process of its
own) write one gzip Chrome trace per rank into the folder, readable by the ``json`` module and
holding the ops of the steps run between start and stop; the steps' output is transformers'
greedy text; starting twice, stopping unstarted and profiling without the variable are
ValueErrors naming why; the server's routes answer 200 / 400 / 404 naming the variable."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, ServerConfig
from kvflow.config.profiler import profiler_options
from kvflow.entrypoints.cli import build_parser

IDS = [1, 5, 9, 13, 17, 21]


def _trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _hf_greedy(tiny, n: int) -> list[int]:
    out = tiny.hf_model.generate(torch.tensor([IDS]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(IDS):].tolist()


def test_offline_profile_writes_a_trace_of_the_steps(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match="no profile is running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(ValueError, match="already running"):
        llm.start_profile()
    (out,) = llm.generate([{"prompt_token_ids": IDS}], greedy, use_tqdm=False)
    (path,) = llm.stop_profile()
    assert list(out.outputs[0].token_ids) == _hf_greedy(tiny_llama, 6)
    assert os.path.dirname(path) == str(tmp_path / "traces") and path.endswith(".json.gz")
    events = _trace_events(path)
    assert any(e.get("ph") == "X" and str(e.get("name", "")).startswith("aten::")
               for e in events), sorted({e.get("name") for e in events})[:20]
    llm.start_profile()  # a second run writes a second file
    (second,) = llm.stop_profile()
    assert second != path and os.path.exists(second) and os.path.exists(path)


def test_profiling_off_without_the_variable(tiny_llama, monkeypatch):
    monkeypatch.delenv("KVFLOW_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32)
    with pytest.raises(ValueError, match="set KVFLOW_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_profiler_options_from_the_environment(tmp_path):
    assert profiler_options({}) is None
    assert profiler_options({"KVFLOW_TORCH_PROFILER_DIR": " "}) is None
    options = profiler_options({"KVFLOW_TORCH_PROFILER_DIR": "rel",
                                "KVFLOW_TORCH_PROFILER_WITH_STACK": "1"})
    assert (options.trace_dir, options.with_stack, options.record_shapes) == \
        (os.path.abspath("rel"), True, False)
    with pytest.raises(ValueError, match="KVFLOW_TORCH_PROFILER_RECORD_SHAPES='yes' is "
                                         "invalid; choose 0 or 1"):
        profiler_options({"KVFLOW_TORCH_PROFILER_RECORD_SHAPES": "yes"})


@pytest.mark.timeout(300)
def test_async_engine_profiles_its_core_process(tiny_llama, tmp_path, monkeypatch):
    from kvflow.engine.async_llm import AsyncLLM

    monkeypatch.setenv("KVFLOW_TORCH_PROFILER_DIR", str(tmp_path))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=32))

    async def run() -> tuple[list[int], list[str]]:
        from kvflow.engine.async_llm import collect

        await engine.start()
        try:
            await engine.start_profile()
            out = await collect(engine.add_request("r", None, IDS, SamplingParams(
                temperature=0, max_tokens=4, ignore_eos=True)))
            return list(out.outputs[0].token_ids), await engine.stop_profile()
        finally:
            await engine.shutdown()

    try:
        tokens, paths = asyncio.run(run())
    finally:
        engine.close()
    assert tokens == _hf_greedy(tiny_llama, 4)
    (path,) = paths
    assert f"pid{os.getpid()}" not in path  # written by the core's process
    assert any(e.get("ph") == "X" for e in _trace_events(path))


def _client(env: dict[str, str]) -> tuple[TestClient, SimpleNamespace]:
    from kvflow.entrypoints.api_server import build_app

    config = ServerConfig.from_cli_args(build_parser().parse_args(["serve"]), env=env)
    calls: list[str] = []

    async def start_profile() -> None:
        if calls and calls[-1] == "start":
            raise ValueError("a profile is already running: call stop_profile first")
        calls.append("start")

    async def stop_profile() -> list[str]:
        calls.append("stop")
        return ["/t/rank0.pt.trace.json.gz"]

    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True, dead_error=None,
                             task="generate", processor=SimpleNamespace(pooler=None),
                             start_profile=start_profile, stop_profile=stop_profile)
    return TestClient(build_app(engine, config, "m")), SimpleNamespace(calls=calls)


def test_server_routes_only_with_the_variable(tmp_path):
    client, _ = _client({})
    for path in ("/start_profile", "/stop_profile"):
        response = client.post(path)
        assert response.status_code == 404
        assert "KVFLOW_TORCH_PROFILER_DIR" in response.json()["error"]["message"]
    client, engine = _client({"KVFLOW_TORCH_PROFILER_DIR": str(tmp_path)})
    assert client.post("/start_profile").status_code == 200
    again = client.post("/start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    stop = client.post("/stop_profile")
    assert (stop.status_code, stop.json()) == (200, {"traces": ["/t/rank0.pt.trace.json.gz"]})
    assert engine.calls == ["start", "stop"]
