"""``thinking_token_budget`` with a grammar applied in the reasoning too (vLLM's
``structured_outputs_config.enable_in_reasoning``; ``SamplingParams.grammar_in_reasoning``):
the budget's markers no longer gate the grammar, which applies from the first token, and the
budget still forces the end marker where the grammar allows it.

Oracles: the same engine's grammar-only run (constrained greedy) for the tokens before the
budget; the tiny tokenizer's own ``encode("</think>")`` for the forced tokens; ``re.fullmatch``
and ``jsonschema`` for the whole reply; hand-written expectations for the server's
SamplingParams. With the old code the budget's markers gated the grammar: the first tokens
were free.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from tests.test_thinking_budget import _markers

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
PROMPT = "a b a b<think>"
REGEX = r'[a-z ]{1,30}</think>\{"ok": (true|false)\}'


def _budgeted(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=3,
                          structured_outputs=StructuredOutputsParams(regex=REGEX), **kw)


def test_budget_with_a_grammar_in_the_reasoning(tiny_llama, tiny_tokenizer, assert_no_leaks):
    """The grammar applies from the first token (a regex that writes the think block
    itself), the budget still forces ``</think>`` after 3 tokens, which the grammar allows,
    and the grammar goes on after it."""
    prompt = tiny_tokenizer.encode(PROMPT)
    grammar = StructuredOutputsParams(regex=REGEX)
    ids = _markers(tiny_tokenizer)
    end = ids.reasoning_end_token_ids
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=128)
    [head] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                    structured_outputs=grammar), use_tqdm=False)
    head = list(head.outputs[0].token_ids)
    assert re.fullmatch("[a-z ]+", tiny_tokenizer.decode(head))  # inside the grammar
    assert head[:len(end)] != end[:len(head)]  # it would not close the block by itself
    budgeted = _budgeted(reasoning_token_ids=ids, grammar_in_reasoning=True)
    [out] = llm.generate([prompt], budgeted, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    assert tokens[:3 + len(end)] == head + end
    text = out.outputs[0].text
    assert re.fullmatch(REGEX, text), text
    jsonschema.validate(json.loads(text.split("</think>", 1)[1]), SCHEMA)
    assert_no_leaks(llm)


@pytest.mark.parametrize("budget,in_reasoning,ids_set,flag", [
    (3, True, True, True),  # the budget's markers; the grammar from the first token
    (None, True, False, False),  # enable_in_reasoning, no budget: no markers at all
    (3, False, True, False),  # default: the grammar after the reasoning
    (None, False, True, False),
])
def test_server_params_keep_enable_in_reasoning_with_a_budget(tiny_tokenizer, budget,
                                                             in_reasoning, ids_set, flag):
    """The server's SamplingParams (``sampling_requests.sampling_params``) under
    ``--structured-outputs-config '{"enable_in_reasoning": true}'`` and a budget: the
    markers for the budget and ``grammar_in_reasoning``, so the engine core makes no
    reasoning gate (before, the budget's markers gated the grammar anyway)."""
    from kvflow.entrypoints.protocol import CompletionRequest
    from kvflow.entrypoints.sampling_requests import sampling_params
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(processor=InputProcessor(tiny_tokenizer, 256, 320, 0))
    ids = _markers(tiny_tokenizer)
    req = CompletionRequest.model_validate({"prompt": "a", "thinking_token_budget": budget,
                                            "structured_outputs": {"regex": REGEX}})
    params = sampling_params(engine, req, 60, None, reasoning=ids,
                             grammar_in_reasoning=in_reasoning)
    assert (params.reasoning_token_ids == ids if ids_set else
            params.reasoning_token_ids is None)
    assert params.grammar_in_reasoning is flag
