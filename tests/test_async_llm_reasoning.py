"""``AsyncLLM``'s reasoning options, the offline ``LLM``'s (vLLM's engine arguments
``reasoning_parser``, ``reasoning_config``, ``structured_outputs_config``; shared code:
``kvflow/inputs/reasoning.py``). Before, ``AsyncLLM`` took none of them (a TypeError), so a
budgeted or constrained request there got no markers.

Oracles, as ``tests/test_llm_reasoning_parser.py``'s: the tiny byte-level tokenizer's own
``encode`` of the marker strings; transformers' plain greedy loop for the free think tokens;
``json.loads`` + ``jsonschema`` for the answer after ``</think>``; the same engine's
grammar-only run and ``re.fullmatch`` for a grammar applied in the reasoning too.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from kvflow import RequestOutputKind, SamplingParams
from kvflow.config import EngineConfig
from kvflow.engine import async_llm
from kvflow.engine.async_llm import AsyncLLM
from kvflow.structured import StructuredOutputsParams
from tests.test_budget_grammar_in_reasoning import PROMPT, REGEX, _budgeted
from tests.test_llm_reasoning_parser import SCHEMA, THINK
from tests.test_thinking_budget import _greedy, _markers

BUDGET = 3
FOX = "the quick brown fox<think>"  # 3 greedy think tokens checked by the offline tests


def _config(path: str, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(model=path, dtype="float32", block_size=4,
                                    num_kv_blocks=128, **kw)


def _run(engine: AsyncLLM, *calls):
    """Run ``calls`` (functions of the engine returning coroutines) at once on a started
    engine; their results, then the engine shut down."""
    async def main():
        await engine.start()
        try:
            return await asyncio.gather(*(call(engine) for call in calls))
        finally:
            await engine.shutdown()

    try:
        return asyncio.run(main())
    finally:
        engine.close()


def _generate(prompt: list[int], params: SamplingParams, request_id: str):
    async def call(engine: AsyncLLM):
        outs = [o async for o in engine.generate(prompt, params, request_id)]
        return outs[-1]
    return call


def _add_request(prompt: list[int], params: SamplingParams, request_id: str):
    async def call(engine: AsyncLLM):
        outs = [o async for o in engine.add_request(request_id, None, prompt, params)]
        return outs[-1]
    return call


# ---- the options, checked before any process starts -------------------------------------
@pytest.mark.parametrize("options,match", [
    ({"reasoning_parser": "r1"}, r"reasoning_parser='r1' is unknown; choose one of"),
    ({"structured_outputs_config": {"backend": "xgrammar"}},
     "structured_outputs_config key 'backend'"),
    ({"reasoning_config": {"reasoning_start_str": "<think>"}}, "needs reasoning_end_str too"),
    ({"reasoning_config": "[1]"}, "reasoning_config=.* must be a JSON object"),
])
def test_bad_options_are_refused_before_the_engine_starts(monkeypatch, options, match):
    def no_start(*args, **kwargs):
        raise AssertionError("the core processes were started")

    monkeypatch.setattr(async_llm, "ReplicaSet", no_start)
    with pytest.raises(ValueError, match=match):
        AsyncLLM(EngineConfig.from_kwargs(model="/nonexistent"), **options)


def test_engine_config_points_reasoning_options_to_llm_and_async_llm():
    """``EngineConfig.from_kwargs`` takes the LLM's keywords but these: its refusal says
    where they go (was: "unknown engine option", pointing at ``kvflow serve --help``)."""
    with pytest.raises(ValueError, match=r"reasoning_parser is not an engine option: give "
                       r"it to LLM\(\.\.\., reasoning_parser=\.\.\.\) or AsyncLLM\(config, "):
        EngineConfig.from_kwargs(model="M", reasoning_parser="think")


# ---- the engine ------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_parser_markers_end_the_budget_and_gate_the_grammar(tiny_llama, tiny_tokenizer):
    """``AsyncLLM(config, reasoning_parser="think")``: ``generate`` with a budget of 3 and a
    JSON schema gives 3 free tokens (transformers' greedy: the grammar starts after the
    reasoning), the forced ``</think>`` (several tokens), then an answer that validates;
    ``add_request`` (token ids in) gets the markers too: 3 free tokens and ``</think>``. The
    caller's params are left as they were."""
    prompt = tiny_tokenizer.encode(FOX)
    think = _greedy(tiny_llama.hf_model, prompt, BUDGET)
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    constrained = SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=BUDGET,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    budgeted = SamplingParams(temperature=0, max_tokens=BUDGET + len(end), ignore_eos=True,
                              thinking_token_budget=BUDGET,
                              output_kind=RequestOutputKind.FINAL_ONLY)
    engine = AsyncLLM(_config(tiny_llama.path), reasoning_parser="think")
    out, low = _run(engine, _generate(prompt, constrained, "json"),
                    _add_request(prompt, budgeted, "low"))
    tokens = list(out.outputs[0].token_ids)
    assert tokens[:BUDGET + len(end)] == think + end and len(end) > 1
    assert tokens[-1] == tiny_tokenizer.eos_token_id  # the grammar ended the reply
    answer = tiny_tokenizer.decode(tokens[BUDGET + len(end):], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert out.outputs[0].text.split("</think>", 1)[1] == answer  # the whole reply, as vLLM
    assert list(low.outputs[0].token_ids) == think + end
    assert constrained.reasoning_token_ids is None and budgeted.reasoning_token_ids is None


@pytest.mark.timeout(300)
def test_enable_in_reasoning_applies_the_grammar_with_a_budget(tiny_llama, tiny_tokenizer):
    """``structured_outputs_config='{"enable_in_reasoning": true}'`` (JSON text, as vLLM's
    flag): the grammar applies from the first token (the same engine's grammar-only run of 3
    tokens, which has no budget and so no markers), the budget still forces ``</think>``
    after 3 tokens, and the reply is the regex's. With the markers gating the grammar (the
    option dropped), the first tokens would be free: the offline test shows they differ."""
    prompt = tiny_tokenizer.encode(PROMPT)
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    head_params = SamplingParams(temperature=0, max_tokens=BUDGET,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    engine = AsyncLLM(_config(tiny_llama.path), reasoning_parser="think",
                      structured_outputs_config='{"enable_in_reasoning": true}')
    head, out = _run(engine, _generate(prompt, head_params, "head"),
                     _generate(prompt, _budgeted(), "budgeted"))
    head = list(head.outputs[0].token_ids)
    assert re.fullmatch("[a-z ]+", tiny_tokenizer.decode(head))  # inside the grammar
    assert list(out.outputs[0].token_ids)[:BUDGET + len(end)] == head + end
    assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text


@pytest.mark.timeout(300)
def test_reasoning_config_alone_ends_the_budget(tiny_llama, tiny_tokenizer):
    """``reasoning_config`` without a parser (a dict): its strings count and end the budget
    (3 free tokens, then the tokens of ``</think>``). Before, such a budget was refused
    (no markers), as it still is on an engine without them."""
    prompt = tiny_tokenizer.encode(FOX)
    think = _greedy(tiny_llama.hf_model, prompt, BUDGET)
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    params = SamplingParams(temperature=0, max_tokens=BUDGET + len(end), ignore_eos=True,
                            thinking_token_budget=BUDGET)
    engine = AsyncLLM(_config(tiny_llama.path), reasoning_config=THINK)
    [out] = _run(engine, _generate(prompt, params, "budget"))
    assert list(out.outputs[0].token_ids) == think + end
