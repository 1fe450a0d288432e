"""``AsyncLLM``'s arguments of another type (request id, priority, LoRA request,
data-parallel rank, tokenization kwargs, the replica-wide calls' arguments): refused in the
API process with a ValueError naming the argument. Before, most reached the engine-core
process as a message its decoder refused; it dropped the message (logging it) and the
caller's stream or call waited for ever. The engine serves on after each refusal."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import SamplingParams
from kvflow.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
IDS = [3, 4, 5]


def _generate(engine, prompt=IDS, params=GREEDY, request_id="r", **kwargs):
    async def drain():
        return [o async for o in engine.generate(prompt, params, request_id, **kwargs)]
    return drain()


BAD_CALLS = [
    (lambda e: _generate(e, request_id=5), r"request_id=5 must be a string, got int"),
    (lambda e: _generate(e, request_id=None), r"request_id=None must be a string"),
    (lambda e: _generate(e, priority=None), r"priority=None must be an integer, got NoneType"),
    (lambda e: _generate(e, priority="x"), r"priority='x' must be an integer, got str"),
    (lambda e: _generate(e, lora_request="x"),
     r"lora_request='x' must be a LoRARequest or None, got str"),
    (lambda e: _generate(e, data_parallel_rank="0"),
     r"data_parallel_rank='0' must be an integer or None, got str"),
    (lambda e: _generate(e, tokenization_kwargs=[1]),
     r"tokenization_kwargs must be a dict or None, got list"),
    (lambda e: e.sleep("1"), r"sleep: level='1' is invalid: Expected `int`, got `str`"),
    (lambda e: e.wake_up("weights"), r"wake_up: tags='weights' is invalid"),
    (lambda e: e.collective_rpc(5), r"collective_rpc: method=5 is invalid"),
    (lambda e: e.collective_rpc("weight_bytes", args=5),
     r"collective_rpc: args=5 must be a list or tuple, got int"),
    (lambda e: e.collective_rpc("weight_bytes", kwargs=[1]),
     r"collective_rpc: kwargs=\[1\] is invalid"),
    (lambda e: e.add_lora("x"), r"add_lora: lora_request='x' is invalid"),
    (lambda e: e.remove_lora("x"), r"remove_lora: lora_int_id='x' is invalid"),
]


@pytest.mark.timeout(300)
def test_arguments_of_another_type_are_refused_not_waited_for(tiny_llama):
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=64))

    async def run():
        await engine.start()
        try:
            (want,) = [o for o in await _generate(engine, request_id="first") if o.finished]
            for i, (call, match) in enumerate(BAD_CALLS):
                with pytest.raises(ValueError, match=match):
                    await asyncio.wait_for(call(engine), 20)  # a hang fails, not stalls
                assert not engine.requests.streams, i  # nothing left open
                outs = await asyncio.wait_for(_generate(engine, request_id=f"ok{i}"), 20)
                assert outs[-1].finished
                assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
        finally:
            await engine.shutdown()

    try:
        asyncio.run(run())
    finally:
        engine.close()
