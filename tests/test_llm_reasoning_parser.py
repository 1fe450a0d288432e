"""The offline ``LLM``'s reasoning options (vLLM's engine arguments ``reasoning_parser``,
``reasoning_config``, ``structured_outputs_config``: ``kvflow/inputs/reasoning.py``,
``kvflow/config/reasoning.py``, ``kvflow/sampling/reasoning_markers.py``).

Oracles: hand-written marker strings and choices; the tiny byte-level tokenizer's own
``encode`` of the marker strings (what vLLM's ``ReasoningConfig`` tokenizes); transformers'
plain greedy loop for the free think tokens; ``json.loads`` + ``jsonschema`` for the answer
after ``</think>``; a regex (``re.fullmatch``) for a grammar applied in the reasoning too.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.config.reasoning import (
    PARSER_MARKERS,
    check_reasoning_parser,
    marker_strings,
    reasoning_config,
)
from kvflow.entrypoints.tool_parsers.reasoning import REASONING_PARSERS
from kvflow.inputs.reasoning import OfflineReasoning, ReasoningOptions
from kvflow.sampling.reasoning_markers import marker_token_ids
from kvflow.structured import StructuredOutputsParams
from kvflow.thinking_budget import ReasoningTokenIds
from tests.test_budget_grammar_in_reasoning import PROMPT, REGEX, _budgeted
from tests.test_thinking_budget import _greedy, _markers

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant><think>{% endif %}")
MESSAGES = [{"role": "user", "content": "kvflow pages keys and values"}]
THINK = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


# ---- the options, hand-computed ----------------------------------------------------------------
def test_parser_markers_are_the_server_parsers_markers():
    assert set(PARSER_MARKERS) == set(REASONING_PARSERS)
    for name, cls in REASONING_PARSERS.items():
        expected = None if cls.reasoning_start_str is None else \
            (cls.reasoning_start_str, cls.reasoning_end_str)
        assert PARSER_MARKERS[name] == expected, name


@pytest.mark.parametrize("parser,config,expected", [
    ("think", None, ("<think>", "</think>")),
    ("mistral", None, ("[THINK]", "[/THINK]")),
    ("seed_oss", None, ("<seed:think>", "</seed:think>")),
    ("granite", None, None),  # vLLM's granite names no markers
    (None, None, None),
    (None, THINK, ("<think>", "</think>")),  # reasoning_config alone (vLLM's)
    ("think", {"reasoning_end_str": "\n</think>"}, ("<think>", "\n</think>")),  # config wins
    ("mistral", {"reasoning_start_str": ""}, ("[THINK]", "[/THINK]")),  # "": unset
    ("granite", THINK, ("<think>", "</think>")),
])
def test_marker_strings_take_the_config_over_the_parser(parser, config, expected):
    assert marker_strings(parser, reasoning_config(config)) == expected


@pytest.mark.parametrize("parser,config,match", [
    ("nope", None, r"reasoning_parser='nope' is unknown; choose one of \['deepseek_r1'"),
    (None, {"reasoning_start_str": "<think>"}, "needs reasoning_end_str too"),
    ("granite", {"reasoning_end_str": "x"}, "needs reasoning_start_str too"),
    (None, {"think_start_str": "<think>"}, "reasoning_config key 'think_start_str'"),
    (None, {"reasoning_start_str": 7}, r"reasoning_config.reasoning_start_str=7 must be"),
    (None, "[1]", "reasoning_config=.* must be a JSON object"),
])
def test_bad_options_are_refused_naming_them(parser, config, match):
    with pytest.raises(ValueError, match=match):
        marker_strings(check_reasoning_parser(parser), reasoning_config(config))


def test_markers_are_tokenized_as_vllm_tokenizes_them(tiny_tokenizer):
    """Several tokens each with the tiny tokenizer (the budget forces them one by one);
    a marker that tokenizes to nothing, or no tokenizer, is refused naming it."""
    ids = marker_token_ids(("<think>", "</think>"), tiny_tokenizer)
    assert ids == _markers(tiny_tokenizer) and len(ids.reasoning_end_token_ids) > 1

    class Empty:
        def encode(self, text, add_special_tokens):
            return [] if text == "" or text == "\u200b" else [3]

    with pytest.raises(ValueError, match=r"reasoning_end_str='\\u200b' tokenizes to no"):
        marker_token_ids(("<think>", "\u200b"), Empty())
    with pytest.raises(ValueError, match="need a tokenizer"):
        marker_token_ids(("<think>", "</think>"), None)


def test_apply_gives_markers_only_where_needed():
    ids, own = ReasoningTokenIds([7], [8, 9]), ReasoningTokenIds([3], [4])
    reasoning = OfflineReasoning(ids)
    grammar = StructuredOutputsParams(json=SCHEMA)
    plain = SamplingParams(max_tokens=5)
    assert reasoning.apply(plain) is plain
    budgeted = reasoning.apply(SamplingParams(thinking_token_budget=2, max_tokens=5))
    assert budgeted.reasoning_token_ids == ids and budgeted.fields_set == \
        {"thinking_token_budget", "max_tokens"}  # the model's defaults still fill the rest
    constrained = reasoning.apply(SamplingParams(structured_outputs=grammar))
    assert constrained.reasoning_token_ids == ids and not constrained.grammar_in_reasoning
    mine = SamplingParams(structured_outputs=grammar, reasoning_token_ids=own)
    assert reasoning.apply(mine) is mine
    inside = OfflineReasoning(ids, grammar_in_reasoning=True)
    assert inside.apply(mine).reasoning_token_ids == own and inside.apply(mine).grammar_in_reasoning
    free = inside.apply(SamplingParams(structured_outputs=grammar))  # no budget: no markers
    assert free.reasoning_token_ids is None and free.grammar_in_reasoning
    assert OfflineReasoning().apply(SamplingParams(structured_outputs=grammar)) \
        .reasoning_token_ids is None
    options = {"reasoning_parser": "think", "structured_outputs_config":
               '{"enable_in_reasoning": true}', "dtype": "float32"}
    assert ReasoningOptions.pop(options) == ReasoningOptions(("<think>", "</think>"), True)
    assert options == {"dtype": "float32"}
    alone = {"reasoning_config": THINK}  # no parser: the markers serve the budget alone
    assert ReasoningOptions.pop(alone) == ReasoningOptions(("<think>", "</think>"), True)


def test_llm_refuses_an_unknown_parser_before_loading():
    with pytest.raises(ValueError, match="reasoning_parser='r1' is unknown"):
        LLM(model="/nonexistent", reasoning_parser="r1")
    with pytest.raises(ValueError, match="structured_outputs_config key 'backend'"):
        LLM(model="/nonexistent", structured_outputs_config={"backend": "xgrammar"})


# ---- the engine --------------------------------------------------------------------------------
def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=128, **kw)


def test_chat_reasons_then_answers_in_the_schema(tiny_llama, tiny_tokenizer, assert_no_leaks):
    """``LLM(reasoning_parser="think")``: chat on a template that opens the think block, a
    budget of 4 and a JSON schema: 4 free tokens (transformers' greedy), the forced
    ``</think>``, then an answer that validates. As in vLLM, ``text`` is the whole reply."""
    budget = 4
    llm = _llm(tiny_llama.path, reasoning_parser="think")
    params = SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=budget,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    [out] = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TEMPLATE)
    assert tiny_tokenizer.decode(out.prompt_token_ids).endswith("<assistant><think>")
    think = _greedy(tiny_llama.hf_model, list(out.prompt_token_ids), budget)
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    tokens = list(out.outputs[0].token_ids)
    assert tokens[:budget + len(end)] == think + end
    assert tokens[-1] == tiny_tokenizer.eos_token_id  # the grammar ended the reply
    answer = tiny_tokenizer.decode(tokens[budget + len(end):], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    text = out.outputs[0].text
    assert text.split("</think>", 1)[1] == answer and not hasattr(out.outputs[0], "reasoning")
    assert params.reasoning_token_ids is None  # the caller's params are left as they were
    assert_no_leaks(llm)


def test_reasoning_config_strings_end_the_budget(tiny_llama, tiny_tokenizer):
    """vLLM's ``reasoning_config`` alone (no parser): its strings, tokenized once, count and
    end the budget (3 free tokens, then the several tokens of ``</think>``); without any
    markers the budget is refused, as vLLM 0.32 refuses it."""
    prompt = tiny_tokenizer.encode("the quick brown fox<think>")
    think = _greedy(tiny_llama.hf_model, prompt, 3)
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    params = SamplingParams(temperature=0, max_tokens=3 + len(end), thinking_token_budget=3,
                            ignore_eos=True)
    llm = _llm(tiny_llama.path, reasoning_config=json.dumps(THINK))
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == think + end
    with pytest.raises(ValueError, match="thinking_token_budget needs the model's reasoning") \
            as err:
        _llm(tiny_llama.path).generate([prompt], params, use_tqdm=False)
    # the offline way to give the markers, not only the server's flag
    assert "build the LLM or AsyncLLM with reasoning_parser=... or reasoning_config=" in str(err.value)


def test_enable_in_reasoning_applies_the_grammar_with_a_budget(tiny_llama, tiny_tokenizer):
    """``structured_outputs_config={"enable_in_reasoning": True}``: a budgeted constrained
    request gets the markers and ``grammar_in_reasoning``, giving the tokens of
    ``tests/test_budget_grammar_in_reasoning.py``'s checked case (the regex that writes the
    think block, ``</think>`` forced after 3 tokens)."""
    prompt = tiny_tokenizer.encode(PROMPT)
    llm = _llm(tiny_llama.path, reasoning_parser="think",
               structured_outputs_config={"enable_in_reasoning": True})
    [out] = llm.generate([prompt], _budgeted(), use_tqdm=False)
    [own] = llm.generate([prompt], _budgeted(reasoning_token_ids=_markers(tiny_tokenizer),
                                             grammar_in_reasoning=True), use_tqdm=False)
    assert out.outputs[0].token_ids == own.outputs[0].token_ids
    assert re.fullmatch(REGEX, out.outputs[0].text)
    gated = _llm(tiny_llama.path, reasoning_parser="think")  # default: after the reasoning
    [after] = gated.generate([prompt], _budgeted(), use_tqdm=False)
    assert after.outputs[0].token_ids != out.outputs[0].token_ids


# ---- the server's --reasoning-config -------------------------------------------------------
def test_server_reasoning_config_flag(tiny_tokenizer):
    """``kvflow serve --reasoning-config JSON`` (vLLM's flag): parsed and checked at start;
    its strings give the budget's markers, winning over the parser's; without a parser a
    grammar applies from the first token (the markers serve the budget alone)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.cli import build_parser
    from kvflow.entrypoints.serving_base import OpenAIServing

    def config(*argv: str) -> ServerConfig:
        args = build_parser().parse_args(["serve", "--model", "M", *argv])
        return ServerConfig.from_cli_args(args, env={})

    def serving(c: ServerConfig):
        return SimpleNamespace(config=c, engine=SimpleNamespace(tokenizer=tiny_tokenizer))

    alone = config("--reasoning-config", json.dumps(THINK))
    assert alone.reasoning_config == THINK
    ids = OpenAIServing.reasoning_token_ids.func(serving(alone))
    assert ids == _markers(tiny_tokenizer)
    assert OpenAIServing.grammar_in_reasoning.fget(serving(alone)) is True
    mixed = config("--reasoning-parser", "mistral", "--reasoning-config",
                   '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}')
    assert OpenAIServing.reasoning_token_ids.func(serving(mixed)) == ids
    assert OpenAIServing.grammar_in_reasoning.fget(serving(mixed)) is False
    with pytest.raises(ValueError, match="reasoning_config needs reasoning_end_str too"):
        config("--reasoning-config", '{"reasoning_start_str": "<think>"}')
    with pytest.raises(ValueError, match="reasoning_config key 'x'"):
        config("--reasoning-config", '{"x": "<think>"}')
