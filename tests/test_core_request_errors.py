"""A request the engine core cannot run reaches its caller as an error, and the engine serves on.

Was: ``EngineCoreProc`` answered a request whose ``EngineCore.add_request`` raised with a
bare ``abort`` output (no ``error``), so ``AsyncLLM`` ended its stream with an empty
``finish_reason="abort"`` output and the server answered 200 with empty text; an exception
other than ValueError ended the core (every request failed). Now:

- an ``AsyncLLM`` whose core refuses a request (a LoRA adapter whose
  ``adapter_model.safetensors`` is corrupt, or whose rank exceeds ``max_lora_rank``: found
  only in the core) raises ``RequestRefused`` (a ValueError) naming the adapter and why, its
  ``field`` ``lora_request``; a request running beside it gets transformers' greedy tokens,
  and every KV block is free afterwards;
- an unexpected exception in the core's ``add_request`` is that request's ``RequestFailed``
  (the server's 500), the request forgotten by the scheduler; a worker's failure
  (``ExecutorError``) still ends the core;
- the server answers a refused LoRA adapter with a 400 naming ``model``, a core failure with
  a 500, and a stream with vLLM's error event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch

from kvflow import SamplingParams
from kvflow.core.request_errors import LORA_REQUEST, RequestError
from kvflow.engine.core_proc import EngineCoreProc
from kvflow.engine.streams import RequestFailed, RequestRefused
from kvflow.executor.base import ExecutorError
from kvflow.lora.request import LoRARequest
from kvflow.request import Request

PROMPT = [1, 5, 9, 13, 17, 21]
OTHER = [40, 41, 42, 43, 44, 45, 46, 47]


def _adapter(folder: str, rank: int, weights: bytes) -> str:
    """A PEFT folder: a LoRA ``adapter_config.json`` of ``rank`` on q_proj, and
    ``weights`` as its ``adapter_model.safetensors``."""
    os.makedirs(folder)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": ["q_proj"], "bias": "none"}, f)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return folder


def _hf_greedy(tiny_llama, ids: list[int], n: int) -> list[int]:
    out = tiny_llama.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


async def _refused_beside_a_good_request(engine, adapters: dict[str, str]):
    """Each bad adapter's request next to a plain one; returns what each bad one raised,
    the plain ones' outputs and the core's stats once idle."""
    from kvflow.engine.async_llm import collect

    await engine.start()
    try:
        errors, kept = {}, []
        for i, (name, path) in enumerate(adapters.items()):
            good = engine.add_request(f"good-{name}", None, OTHER, SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=12))
            bad = engine.add_request(f"bad-{name}", None, PROMPT, SamplingParams(
                temperature=0, max_tokens=4, n=2), lora_request=LoRARequest(name, i + 1, path))
            try:
                await asyncio.wait_for(collect(bad), 60)
            except (RequestRefused, RequestFailed) as e:
                errors[name] = e
            kept.append(await asyncio.wait_for(collect(good), 60))
        for _ in range(200):  # the stats of the step after the last request reach us
            stats = engine.stats[0]
            if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
                    (0, 0, stats.num_usable_blocks):
                break
            await asyncio.sleep(0.05)
        return errors, kept, engine.stats[0]
    finally:
        await engine.shutdown()


@pytest.mark.timeout(300)
def test_async_llm_raises_what_the_core_refused(tiny_llama, tmp_path):
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    adapters = {"corrupt": _adapter(str(tmp_path / "corrupt"), 4, b"\x00not safetensors"),
                "wide": _adapter(str(tmp_path / "wide"), 16, b"")}
    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", num_kv_blocks=48, block_size=4,
        enable_lora=True, max_loras=1, max_lora_rank=8))
    try:
        errors, kept, stats = asyncio.run(_refused_beside_a_good_request(engine, adapters))
    finally:
        engine.close()
    assert set(errors) == {"corrupt", "wide"}  # was: an empty "abort" output, no error
    for name, error in errors.items():
        assert isinstance(error, RequestRefused) and isinstance(error, ValueError)
        assert error.field == LORA_REQUEST and error.request_id == f"bad-{name}"
    corrupt, wide = str(errors["corrupt"]), str(errors["wide"])
    assert f"{adapters['corrupt']}/adapter_model.safetensors' is truncated or corrupt" in corrupt
    assert "LoRA adapter 'wide'" in wide and "rank 16 exceeds max_lora_rank=8" in wide
    reference = _hf_greedy(tiny_llama, OTHER, 12)
    for out in kept:  # the request beside each refused one ran on, unchanged
        assert out.outputs[0].token_ids == reference
        assert out.outputs[0].finish_reason == "length"
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
        (0, 0, stats.num_usable_blocks)


def _loop(add_request) -> tuple[EngineCoreProc, SimpleNamespace]:
    """An ``EngineCoreProc`` over a stand-in core whose ``add_request`` is ``add_request``
    (it may put the request in the stand-in scheduler first)."""
    scheduler = SimpleNamespace(requests={})
    aborted = []
    core = SimpleNamespace(
        config=SimpleNamespace(scheduler_config=SimpleNamespace(admission_control=False)),
        scheduler=scheduler, add_request=lambda r: add_request(r, scheduler),
        abort_requests=lambda ids, stopped=False: aborted.extend(ids)
        or [scheduler.requests.pop(i) for i in ids],
        structured_output=None)
    core.aborted = aborted
    return EngineCoreProc(core, None, None), core


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=2))


def test_core_failure_on_one_request_is_its_500_not_the_engines():
    def add(request, scheduler):
        scheduler.requests[request.request_id] = request  # queued, then it failed
        raise KeyError("slot")
    loop, core = _loop(add)
    other = _request("r")
    core.scheduler.requests["r"] = other  # a request of the same id already running
    out = loop._add(_request("r"))
    assert out.internal_error and out.finish_reason == "abort" and out.error_field is None
    assert out.error == "the engine failed on request 'r': KeyError: 'slot'"
    assert core.aborted == ["r"] and core.scheduler.requests == {}  # was: the core died

    def refuse(request, scheduler):
        raise RequestError("adapter 'a' is corrupt", LORA_REQUEST)
    loop, core = _loop(refuse)
    out = loop._add(_request("x"))
    assert (out.error, out.error_field, out.internal_error) == \
        ("adapter 'a' is corrupt", LORA_REQUEST, False)
    assert core.aborted == []

    def worker_died(request, scheduler):
        raise ExecutorError("worker 1 died")
    loop, _ = _loop(worker_died)
    with pytest.raises(ExecutorError):  # the engine's failure: the loop ends (EngineFailed)
        loop._add(_request("y"))


def test_server_answers_name_the_field_and_stream_an_error_event():
    from kvflow.entrypoints.engine_requests import refused, stream

    lora = refused(RequestRefused("LoRA adapter 'a' cannot be loaded", "x",
                                  field=LORA_REQUEST), "response_format")
    assert (lora.status, lora.param, lora.type) == (400, "model", "invalid_request_error")
    grammar = refused(RequestRefused("grammar failed", "x", field="structured_outputs"),
                      "response_format")
    assert (grammar.status, grammar.param) == (400, "response_format")
    failed = refused(RequestFailed("the engine failed on request 'x': KeyError", "x"), None)
    assert (failed.status, failed.type, failed.code) == \
        (500, "InternalServerError", "internal_error")

    class Chunk:
        def model_dump_json(self) -> str:
            return '{"text": "a"}'

    async def chunks():
        yield Chunk()
        raise RequestRefused("LoRA adapter 'a' cannot be loaded", "x", field=LORA_REQUEST)

    async def body() -> list[str]:
        return [part async for part in stream([], chunks(), lambda streams: None)]
    parts = asyncio.run(body())
    assert parts[0] == 'data: {"text": "a"}\n\n' and parts[-1] == "data: [DONE]\n\n"
    error = json.loads(parts[1].removeprefix("data: "))["error"]
    assert (error["message"], error["param"], error["type"]) == \
        ("LoRA adapter 'a' cannot be loaded", "model", "invalid_request_error")
