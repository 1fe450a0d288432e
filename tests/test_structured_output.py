"""Structured output on the tiny random model: the grammar alone forces the shape, so every
output that ends with ``stop`` must parse and match; unconstrained rows in the same batch are
untouched; preemption keeps the matcher in step; bad constraints fail loudly, never hang."""

from __future__ import annotations

import codecs
import json
import math
import re

import jsonschema
import msgspec
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.sampler import apply_token_bitmask, apply_token_bitmask_fast
from kvflow.structured import StructuredOutputsParams, validate
from kvflow.structured.schema_support import unenforced_keyword

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "tags"]}
PROMPTS = ["the quick brown fox", "kvflow pages keys", "prefix caching reuses them,",
           "chunked prefill splits long prompts,"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, num_kv_blocks=64, block_size=16)


def _run(llm, params_list, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, params_list, use_tqdm=False)]


def _constrained(seed: int, max_tokens: int = 64, **kind) -> SamplingParams:
    return SamplingParams(temperature=0.7, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def test_json_schema_outputs_validate(llm, assert_no_leaks):
    outs = _run(llm, [_constrained(i, json=SCHEMA) for i in range(len(PROMPTS))])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, [o.text for o in outs]
    for o in stopped:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert_no_leaks(llm)


def test_length_limited_strings_are_json_strings(llm):
    """minLength / maxLength strings: xgrammar 0.2.9's grammar for them admits raw control
    characters (U+0000-U+001F but CR, LF), which JSON forbids inside a string; on this tiny
    model half the outputs had one and did not parse. The backend narrows the class."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
                                                     "maxLength": 5}}, "required": ["s"]}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i in range(8)]
    outs = _run(llm, params, ["a b a b"] * 8)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6, [o.text for o in outs]
    for o in stopped:
        jsonschema.validate(json.loads(o.text), schema)


def test_json_object(llm):
    outs = _run(llm, [_constrained(i, 48, json_object=True) for i in range(len(PROMPTS))])
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")


def test_regex_full_match(llm):
    pattern = r"[a-z]{2,6}-\d{2}(\.[0-9])?"
    outs = _run(llm, [_constrained(i, 32, regex=pattern) for i in range(len(PROMPTS))])
    for o in outs:  # a finite language: every output must end well before max_tokens
        assert o.finish_reason == "stop"
        assert re.fullmatch(pattern, o.text), o.text


def test_regex_dot_is_not_a_newline(llm):
    """xgrammar's ``.`` matches a newline, where Python's ``re`` (and JavaScript's, PCRE's)
    does not: with the newline token favoured, ``x.y`` gave ``"x\ny"``, which
    ``re.fullmatch`` refuses. ``.`` is now sent as ``[^\n]``; a newline the regex names
    itself still passes."""
    (newline,) = llm.get_tokenizer().encode("\n")
    outs = _run(llm, [SamplingParams(temperature=0, max_tokens=12, logit_bias={newline: 30.0},
                                     structured_outputs=StructuredOutputsParams(regex=regex))
                      for regex in ("x.y", "x(.|\n)y")], PROMPTS[:2])
    assert [o.finish_reason for o in outs] == ["stop", "stop"], outs
    assert re.fullmatch("x.y", outs[0].text) and "\n" not in outs[0].text, outs[0].text
    assert outs[1].text == "x\ny"


def test_regex_letter_anchors_are_refused(llm):
    """xgrammar reads ``\\A``, ``\\Z`` and ``\\z`` as the letters: ``\\Aab\\Z`` forced
    the output ``AabZ``. Refused, naming the anchor to write instead; ``^``/``$`` work."""
    with pytest.raises(ValueError, match=r"\\A at position 0 is read as the letter 'A'.*"
                                         r"write '\^' instead"):
        llm.generate(PROMPTS[0], _constrained(0, regex=r"\Aab\Z"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = _run(llm, [_constrained(0, regex=r"^ab$")], PROMPTS[:1])
    assert (out.text, out.finish_reason) == ("ab", "stop")


_ANY = r"[^\n\uD800-\uDFFF]"  # "." as sent: no newline, no UTF-16 surrogate
_NOT_DIGIT = r"[\u0000-\u002F\u003A-\uD7FF\uE000-\u{10FFFF}]"  # [\D] as sent


@pytest.mark.parametrize("pattern, sent", [
    ("a.b", f"a{_ANY}b"), (r"a\.b", r"a\.b"), ("[.]", "[.]"),
    ("[^.]+.", r"[^.\uD800-\uDFFF]+" + _ANY), (r"\\.", "\\\\" + _ANY),
    (r"a[\].]b.", r"a[\].]b" + _ANY), (r"(.|\n)*", f"({_ANY}|\\n)*"),
    (r"\D[\D]\w\S", r"[^\d\uD800-\uDFFF]" + _NOT_DIGIT + r"\w[^\s\uD800-\uDFFF]"),
    (r"[^]]", r"[^\uD800-\uDFFF]]")])
def test_regex_sent_to_xgrammar(pattern, sent):
    from kvflow.structured.regex_dialect import xgrammar_regex

    assert xgrammar_regex(pattern) == sent


def test_choice_with_cjk_and_emoji(llm):
    choices = ["北京🙂", "東京タワー", "kvflow ✓"]
    outs = _run(llm, [_constrained(i, 32, choice=choices) for i in range(len(PROMPTS))])
    for o in outs:
        assert o.finish_reason == "stop" and o.text in choices, o.text


def test_grammar_ebnf(llm):
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = _run(llm, [_constrained(i, 40, grammar=grammar) for i in range(len(PROMPTS))])
    for o in outs:
        if o.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", o.text), o.text


def _token_ids(tokenizer, keep) -> list[int]:
    """The ids of the tokens whose text passes ``keep``."""
    return [i for i in range(len(tokenizer)) if keep(tokenizer.decode([i]))]


def test_allowed_token_ids_missing_the_grammar_start_are_refused(llm, assert_no_leaks):
    """A JSON object's text begins with ``{`` or whitespace, so allowed_token_ids of
    letters-only tokens leave a JSON schema's first step nothing to sample: the request is
    refused naming allowed_token_ids (the call's other prompt aborted), not run to an empty
    ``length``. With the tokens that begin with ``{`` allowed too it runs and starts with one."""
    tokenizer = llm.get_tokenizer()
    letters = _token_ids(tokenizer, str.isalpha)
    assert len(letters) > 50
    refused = SamplingParams(max_tokens=8, allowed_token_ids=letters,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with pytest.raises(ValueError, match=r"^prompt 1: SamplingParams\.allowed_token_ids allows "
                                         r"none of the tokens the JSON schema can start with"):
        llm.generate(PROMPTS[:2], [_constrained(0, json=SCHEMA), refused], use_tqdm=False)
    assert_no_leaks(llm)
    braces = _token_ids(tokenizer, lambda text: text.startswith("{"))
    params = SamplingParams(max_tokens=8, allowed_token_ids=letters + braces,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (out,) = _run(llm, [params], PROMPTS[:1])
    assert out.token_ids[0] in braces and out.text.startswith("{")
    assert set(out.token_ids) <= set(letters + braces)
    assert_no_leaks(llm)


def test_mixed_batch_leaves_unconstrained_rows_untouched(llm):
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)]
    alone = _run(llm, free, PROMPTS[:2])
    mixed = _run(llm, [free[0], _constrained(1, choice=["北京🙂", "yes"]), free[1],
                       _constrained(2, json=SCHEMA)], [PROMPTS[0], PROMPTS[1], PROMPTS[1],
                                                      PROMPTS[2]])
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[1].token_ids
    assert mixed[1].text in ("北京🙂", "yes")


def test_preemption_keeps_matcher_in_step(tiny_llama, assert_no_leaks):
    """A KV pool too small for the batch: requests are preempted and recomputed mid-output.
    Recompute never resamples, so each matcher has accepted exactly the output tokens."""
    llm = LLM(model=tiny_llama.path, num_kv_blocks=9, block_size=4, max_num_seqs=4)
    regex = r"[a-z]{4}( [a-z]{4}){3}"
    outs = llm.generate(PROMPTS, [_constrained(i, 40, regex=regex) for i in range(4)],
                        use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    assert_no_leaks(llm)


def test_preempted_samples_of_n_equal_the_unpreempted_run(tiny_llama, assert_no_leaks):
    """n=2 seeded samples per constrained request (JSON schema and regex) in a pool too
    small for them: preempted and recomputed mid-output, each sample's tokens and logprobs
    are those of the same requests in a pool that never preempts (every child's matcher
    stays in step with its own output)."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}

    def run(llm):
        params = [SamplingParams(temperature=0.8, seed=100 + i, n=2, max_tokens=40, logprobs=1,
                                 structured_outputs=StructuredOutputsParams(json=schema)
                                 if i % 2 else StructuredOutputsParams(
                                     regex=r"[a-z]{3,6}( [a-z]{2,5}){2,6}\.")) for i in range(4)]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(c.text, c.finish_reason, c.token_ids,
                 [round(step[t].logprob, 4) for t, step in zip(c.token_ids, c.logprobs)])
                for o in outs for c in o.outputs]

    common = {"model": tiny_llama.path, "block_size": 4, "max_model_len": 88}
    expected = run(LLM(num_kv_blocks=400, **common))
    small = LLM(num_kv_blocks=24, max_num_seqs=8, **common)
    assert run(small) == expected
    assert small.engine.core.scheduler.num_preemptions > 0
    assert sum(finish == "stop" for _, finish, _, _ in expected) >= 4
    assert_no_leaks(small)


def test_unbounded_grammar_stops_at_max_tokens(llm):
    outs = _run(llm, [_constrained(0, 10, grammar='root ::= "a" root | "a"')], PROMPTS[:1])
    assert outs[0].finish_reason in ("length", "stop") and len(outs[0].token_ids) <= 10
    assert set(outs[0].text) <= {"a"}


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_grammar_that_admits_nothing_ends_with_length(llm, tiny_llama, temperature):
    """min_tokens bans EOS, the only token a finished choice allows: nothing is allowed, so
    the request ends at once with ``length`` instead of emitting a forbidden token. The tiny
    vocabulary's EOS is id 0, what an all -inf row yields: it was emitted (min_tokens
    broken, its logprob NaN)."""
    assert tiny_llama.eos_token_id == 0
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=20, min_tokens=10,
                            logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = _run(llm, [params], PROMPTS[:1])[0]
    assert out.finish_reason == "length" and out.text == "yes"
    assert 0 not in out.token_ids
    assert all(math.isfinite(entry[t].logprob) for entry, t in zip(out.logprobs,
                                                                     out.token_ids))


@pytest.mark.parametrize("kind, text", [({"choice": ["yes"]}, "yes"),
                                        ({"regex": "[a-c]{2,8}"}, None)])
def test_ignore_eos_ends_with_stop_once_the_grammar_completes(llm, tiny_llama, kind, text):
    """``ignore_eos`` cannot carry a request past a complete grammar: the grammar then admits
    only the EOS, and once it took it nothing more is allowed. The request ends right there
    with ``stop`` (no stop_reason: the EOS stopped it), the EOS (id 0) its last token; it
    used to end with ``length`` one step later. "yes" + EOS is 2-4 tokens, well before
    ``max_tokens``; the regex here runs to its 8 characters and the forced EOS is the 9th
    token, the last ``max_tokens`` allows: still ``stop``, the output being complete."""
    assert tiny_llama.eos_token_id == 0
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(**kind))
    out = _run(llm, [params], PROMPTS[:1])[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None), out
    assert out.token_ids[-1] == 0 and 0 not in out.token_ids[:-1]
    assert len(out.token_ids) <= 9
    assert out.text == text if text else re.fullmatch(kind["regex"], out.text), out.text


@pytest.mark.parametrize("kind, bad, needle", [
    ("json", '{"type": "object", "properties": ', "JSON"),
    ("json", {"type": "frobnicate"}, "frobnicate"),
    ("regex", "(abc", "regex"),
    ("grammar", "root ::= undefined_rule", "undefined_rule"),
])
def test_bad_constraints_raise(llm, kind, bad, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(PROMPTS[0], _constrained(0, **{kind: bad}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


_OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}


@pytest.mark.parametrize("schema, violating, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1],
     "'uniqueItems'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [5],
     "'contains'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "x", "'allOf'"),
    ({**_OBJ_AB, "properties": {"a": {"type": "integer", "not": {"const": 0}}}}, {"a": 0},
     "'not' at properties.a"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "'multipleOf'"),
    ({**_OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}, "'dependentRequired'"),
    ({**_OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
     {"a": 1}, "'if'"),
    # xgrammar builds a schema object from its $ref / const / enum / anyOf / oneOf / allOf
    # alone and drops the keywords beside it
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 5}, 7,
     "'maximum': dropped beside '$ref'"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "string"}, 1,
     "'type': dropped beside 'anyOf'"),
    ({"allOf": [{"type": "integer"}], "minimum": 5}, 1, "'minimum': dropped beside 'allOf'"),
    ({**_OBJ_AB, "properties": {"b": {"enum": ["a", "bbbb"], "maxLength": 2}}},
     {"b": "bbbb"}, "'maxLength' at properties.b: dropped beside 'enum'"),
    ({"const": "a", "type": "integer"}, "a", "'type': dropped beside 'const'"),
    # only the listed properties are required; their names escape propertyNames
    ({"type": "object", "required": ["x"]}, {}, "'required': 'x' is not under 'properties'"),
    ({**_OBJ_AB, "required": ["a", "c"]}, {"a": 1}, "'required': 'c'"),
    ({**_OBJ_AB, "propertyNames": {"pattern": "^b"}}, {"a": 1}, "'propertyNames'"),
    ({"type": "object", "additionalProperties": False, "propertyNames": {"maxLength": 1}},
     {"a": "x"}, "'propertyNames': beside additionalProperties false"),
    ({**_OBJ_AB, "patternProperties": {"^b": {"type": "integer"}}}, {"b": "x"},
     "'patternProperties': '^b' also matches 'b'"),
    ({"type": "string", "format": "date", "pattern": "^2024"}, "2023-01-01",
     "'pattern': not enforced together with format 'date'"),
    ({"type": "integer", "multipleOf": 2.5}, 2, "'multipleOf': enforced for whole numbers"),
    ({"type": "integer", "minimum": 0, "multipleOf": 3}, 4,
     "'multipleOf': enforced with no bounds, or with both within 10,000"),
    ({"type": "integer", "minimum": 0, "exclusiveMaximum": 10_001, "multipleOf": 3}, 4,
     "'multipleOf'"),
    # a keyword of one type in a schema that names no type (nor one xgrammar reads from
    # properties / items): xgrammar writes any value and drops it
    ({"minimum": 3}, 1, "'minimum': enforced only with a 'type'"),
    ({**_OBJ_AB, "properties": {"a": {"exclusiveMaximum": 3}}}, {"a": 3},
     "'exclusiveMaximum' at properties.a: enforced only with a 'type'"),
    ({"maxLength": 2}, "abc", "'maxLength': enforced only with a 'type'"),
    ({"type": "array", "items": {"pattern": "^a$"}}, ["b"], "'pattern' at items"),
    ({"maxItems": 1}, [1, 2], "'maxItems'"),
    ({"minProperties": 1}, {}, "'minProperties'"),
    ({"patternProperties": {"^a": {"type": "integer"}}}, {"a": "x"}, "'patternProperties'"),
    ({"anyOf": [{"propertyNames": {"maxLength": 1}}, {"type": "string"}]}, {"ab": 1},
     "'propertyNames' at anyOf.0"),
])
def test_schema_keywords_the_grammar_ignores_are_refused(schema, violating, keyword):
    """Keywords xgrammar compiles but does not enforce: its grammar takes an instance that
    breaks them (jsonschema says so), so a schema using one is a ValueError naming it and
    where it is (was served as the looser schema)."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    text = json.dumps(violating)
    assert not jsonschema.Draft202012Validator(schema).is_valid(violating)
    assert _is_grammar_accept_string(  # the keyword is still ignored by xgrammar itself
        Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)
    with pytest.raises(ValueError, match="does not enforce") as err:
        validate(StructuredOutputsParams(json=schema))
    assert keyword in str(err.value)
    # what it does enforce passes: annotations and keywords that ask nothing beside a oneOf,
    # a type that every enum value has, required properties that are listed
    validate(StructuredOutputsParams(json={
        "oneOf": [{"type": "integer", "minimum": 1, "maximum": 99}, {"type": "string"}],
        "title": "t", "description": "d", "default": 3, "uniqueItems": False, "required": []}))
    validate(StructuredOutputsParams(json={
        "$defs": {"c": {"enum": ["red", 2], "type": ["string", "integer"]}},
        "type": "object", "properties": {"c": {"$ref": "#/$defs/c", "description": "d"},
                                         "n": {"const": 1.0, "type": "integer"}},
        "required": ["c", "n"]}))
    validate(StructuredOutputsParams(json={  # 10,000 integers: listed, so kept
        "type": "integer", "minimum": 1, "exclusiveMaximum": 10_001, "multipleOf": 3}))
    validate(StructuredOutputsParams(json={  # properties named like keywords; empty ones
        "type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
        "dependentRequired": {}}))
    # no type, but one xgrammar reads from properties / items and enforces the keyword in
    validate(StructuredOutputsParams(json={"properties": {}, "maxProperties": 1}))
    validate(StructuredOutputsParams(json={"items": {}, "maxItems": 1, "minLength": 0}))
    # a propertyNames schema needs no type: names are strings, and their lengths are kept
    validate(StructuredOutputsParams(json={"type": "object",
                                           "propertyNames": {"maxLength": 3}}))


@pytest.mark.parametrize("schema, ending", [
    # the reason says how to write it instead: no "leave it out" beside that advice
    ({"minimum": 3}, ('add "type": "number" (xgrammar, kvflow\'s grammar engine, accepts '
                      "this keyword but does not enforce it)")),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3},
     "(xgrammar, kvflow's grammar engine, accepts this keyword but does not enforce it)"),
    # no other way to write it: leave it out
    ({"type": "array", "uniqueItems": True},
     "accepts this keyword but does not enforce it; leave it out)"),
])
def test_a_refused_keyword_gets_one_piece_of_advice(schema, ending):
    """A refusal whose reason gives the fix (add a type, write the length into the pattern) does
    not also say "leave it out" (was both: 'add "type": "number" (... leave it out)')."""
    with pytest.raises(ValueError) as err:
        validate(StructuredOutputsParams(json=schema))
    assert str(err.value).endswith(ending), str(err.value)


@pytest.mark.parametrize("schema, violating", [
    ({"properties": {}, "maxProperties": 1}, {"a": 1, "b": 2}),
    ({"additionalProperties": {"type": "integer"}, "patternProperties": {"^x": {}},
      "maxProperties": 1}, {"a": 1, "b": 2}),
    ({"items": {"type": "integer"}, "maxItems": 1}, [1, 2]),
    ({"prefixItems": [{"type": "integer"}], "minItems": 1}, []),
])
def test_keywords_of_a_type_xgrammar_reads_from_the_schema_are_enforced(schema, violating):
    """Without a ``type``, xgrammar reads one from ``properties`` / ``items`` (and the like)
    and enforces that type's keywords: such a schema is taken, and its grammar refuses what
    jsonschema refuses."""
    from xgrammar.testing import _is_grammar_accept_string

    from kvflow.structured.xgrammar_convert import json_schema_grammar

    assert not jsonschema.Draft202012Validator(schema).is_valid(violating)
    validate(StructuredOutputsParams(json=schema))
    grammar = json_schema_grammar(json.dumps(schema))
    assert not _is_grammar_accept_string(grammar, json.dumps(violating))


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "array", "maxItems": 3}, [[1, "a"], []], [[1, 2, 3, 4]]),
    ({"type": "array", "minItems": 2}, [[1, "a"], [None, {}, 3]], [[1], []]),
    ({"type": "object", "properties": {"a": {"type": ["array", "null"], "minItems": 1}},
      "required": ["a"]}, [{"a": [True]}, {"a": None}], [{"a": []}]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": True, "maxItems": 2},
     [[1, "x"], []], [["x"], [1, 2, 3]]),
])
def test_arrays_without_items_take_any_items(schema, good, bad):
    """JSON Schema reads an array without ``items`` as one of any items, and so does
    xgrammar 0.2.9 for ``{"type": "array"}`` alone; beside ``maxItems`` it read it as one
    of none (``{"type": "array", "maxItems": 3}`` took only ``[]``) and refused
    ``minItems`` ("additional items are not allowed"). Oracle: jsonschema."""
    from xgrammar.testing import _is_grammar_accept_string

    from kvflow.structured.xgrammar_convert import json_schema_grammar

    grammar = json_schema_grammar(json.dumps(schema))
    for value in good + bad:
        expected = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert expected == (value in good), value
        text = json.dumps(value, separators=(", ", ": "))
        assert _is_grammar_accept_string(grammar, text) == expected, text


def test_min_properties_met_by_repeated_names_is_refused():
    """xgrammar keeps the names of unlisted properties apart from the listed ones but not
    from each other: ``{"x": 1, "x": 2}`` passed ``minProperties: 2``, and parses to one
    property. Refused where unlisted names could make up the count."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "additionalProperties": {"type": "integer"},
              "minProperties": 2}
    text = '{"x": 1, "x": 2}'
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    assert _is_grammar_accept_string(
        Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)
    with pytest.raises(ValueError, match="'minProperties': counted with repeated names"):
        validate(StructuredOutputsParams(json=schema))
    validate(StructuredOutputsParams(json={  # two required listed properties meet it
        **schema, "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"]}))


def test_empty_any_of_is_refused():
    """An empty ``anyOf`` / ``oneOf`` (no value matches) compiled to a grammar that takes the
    empty text: ``{"a": }`` passed this schema, and a constrained output was not JSON."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}
    assert _is_grammar_accept_string(
        Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), '{"a": }')
    for key in ("anyOf", "oneOf"):
        with pytest.raises(ValueError, match=rf"'{key}' at properties.a: an empty list"):
            validate(StructuredOutputsParams(json={**schema, "properties": {"a": {key: []}}}))


def test_pydantic_schemas_pass():
    """What pydantic writes for a model (annotations and ``type`` beside ``$ref`` / ``enum``
    / ``anyOf``, discriminated unions) is not refused as unenforced."""
    import enum
    from typing import Literal

    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red, blue = "red", "blue"

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=1, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        name: str = Field(min_length=1, max_length=8)

    class Pet(BaseModel):
        color: Color = Color.red
        pet: Cat | Dog = Field(discriminator="kind")
        friend: Cat | None = None
        friends: list[Dog] = Field(default_factory=list, max_length=3)
        owner: Dog = Field(description="the owner")

    schema = Pet.model_json_schema()
    assert unenforced_keyword(schema) is None
    validate(StructuredOutputsParams(json=schema))


def test_params_validation_and_msgspec_round_trip():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    data = msgspec.msgpack.encode(params)
    back = msgspec.msgpack.decode(data, type=SamplingParams)
    assert back.structured_outputs.key == params.structured_outputs.key


def test_bitmask_matches_xgrammar_and_skips_other_rows():
    """The sampler's torch masking against xgrammar's own kernel (the oracle)."""
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64) \
        .to(torch.int32)
    logits = torch.randn(4, vocab, generator=gen)
    expected = logits.clone()
    full = torch.zeros(4, 3, dtype=torch.int32)  # xgrammar indexes logits and bitmask alike
    full[[1, 3]] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, indices=[1, 3], vocab_size=vocab)
    ours = logits.clone()
    apply_token_bitmask(ours, [1, 3], bitmask)
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    fast = logits.clone()
    apply_token_bitmask_fast(fast, [1, 3], bitmask)  # what the sampler runs
    assert torch.equal(fast, expected)


def test_matcher_accept_and_rollback(tiny_tokenizer):
    from kvflow.structured.xgrammar_backend import XgrammarBackend

    backend = XgrammarBackend(tiny_tokenizer, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(choice=["fox"])))
    ids = tiny_tokenizer.encode("fox")
    assert matcher.accept_tokens(ids) and matcher.num_accepted_tokens == len(ids)
    assert not matcher.accept_tokens(tiny_tokenizer.encode("x"))
    matcher.rollback(len(ids))
    assert matcher.num_accepted_tokens == 0
    assert matcher.accept_tokens(ids + [tiny_tokenizer.eos_token_id])
    assert matcher.is_terminated()


def test_json_schema_keeps_property_order(llm):
    """Properties "zeta" then "alpha" (both required): the output's keys follow the schema's
    order, as OpenAI's structured outputs do (the grammar was compiled from key-sorted text)."""
    schema = {"type": "object", "properties": {
        "zeta": {"type": "integer", "minimum": 0, "maximum": 9},
        "alpha": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["zeta", "alpha"]}
    reordered = {"type": "object", "properties": dict(reversed(schema["properties"].items())),
                 "required": ["zeta", "alpha"]}
    a, b = StructuredOutputsParams(json=schema), StructuredOutputsParams(json=reordered)
    assert a.key != b.key  # different constraints: no shared cache entry
    outs = _run(llm, [_constrained(i, 32, json=schema) for i in range(2)] +
                [_constrained(i, 32, json=reordered) for i in range(2)])
    for o, order in zip(outs, [["zeta", "alpha"]] * 2 + [["alpha", "zeta"]] * 2):
        assert o.finish_reason == "stop", o.text
        assert [k for k, _ in json.loads(o.text, object_pairs_hook=list)] == order, o.text


def test_required_tool_calls_name_before_arguments(llm):
    """tool_choice "required": each call object is written name first, then arguments, so the
    model picks the function before writing its arguments."""
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.structured_requests import tool_constraint

    tools = [{"type": "function", "function": {"name": f, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"]}}} for f in ("get_a", "get_b")]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice="required", parallel_tool_calls=False)
    constraint = tool_constraint(req, "required")
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=48,
                             structured_outputs=constraint) for i in range(2)]
    for o in _run(llm, params, PROMPTS[:2]):
        assert o.finish_reason == "stop", o.text
        calls = json.loads(o.text, object_pairs_hook=list)
        assert [k for k, _ in calls[0]] == ["name", "arguments"], o.text


def test_required_tool_calls_resolve_each_tools_references(llm):
    """tool_choice "required" nests each function's parameters inside an array of calls, so
    their local references (pydantic's ``#/$defs/Name``, a recursive ``#``) named the array's
    root: a 400 ("Cannot find field '$defs'") for any pydantic-made tool, and ``#`` the call
    array. They now point into the parameters where they sit; each sampled call's arguments
    validate against its function's own parameters (jsonschema)."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.structured_requests import tool_constraint

    city = {"type": "object", "$defs": {"City": {"enum": ["paris", "rome"]}},
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
    tree = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}, "sub": {"$ref": "#"}},
            "required": ["n"]}
    parameters = {"get_city": city, "tree": tree}
    for names in (["get_city"], ["get_city", "tree"]):
        req = ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], tool_choice="required",
            tools=[{"type": "function", "function": {"name": n, "parameters": parameters[n]}}
                   for n in names])
        constraint = tool_constraint(req, "required")
        validate(constraint)  # raised "Cannot find field '$defs' in #/$defs/City"
        grammar = Grammar.from_json_schema(json.dumps(constraint.json), any_whitespace=False)
        call = '[{"name": "get_city", "arguments": {"city": "%s"}}]'
        assert _is_grammar_accept_string(grammar, call % "rome")
        assert not _is_grammar_accept_string(grammar, call % "oslo")
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                 structured_outputs=constraint) for i in range(4)]
        stopped = [o for o in _run(llm, params) if o.finish_reason == "stop"]
        assert stopped
        for o in stopped:
            for c in json.loads(o.text):
                jsonschema.validate(c["arguments"], parameters[c["name"]])
    tree_call = '[{"name": "tree", "arguments": {"n": 1, "sub": %s}}]'
    assert _is_grammar_accept_string(grammar, tree_call % '{"n": 2}')
    assert not _is_grammar_accept_string(  # "#" was the array of calls
        grammar, tree_call % '[{"name": "tree", "arguments": {"n": 2}}]')


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "pattern": "^[a-z]{1,2000000}$"}, "pattern"),  # past MAX_COUNT
    ({"type": "string", "pattern": "^(abcdefghij){1,100000}$"}, "pattern"),  # 12 chars repeated
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x{150000,}"},
                                       "b": {"type": "string", "pattern": "y{150000}"}}},
     "properties.b"),  # neither alone, both together
    ({"type": "object", "patternProperties": {"^k{1,5000}$": {"type": "integer"}}},
     "patternProperties"),  # xgrammar converts these: the quadratic budget
])
def test_patterns_too_costly_to_convert_are_refused(schema, where):
    """xgrammar converted a schema's string ``pattern`` in time that grows with the square
    of each counted repetition: "^[a-z]{1,50000}$" took ~95 s here, during which the API
    server's event loop (it validates the schema) and then the engine core (it validates it
    again when the request is added) served nobody. kvflow now converts ``pattern`` strings
    itself, in time linear in the counts of groups and literals and constant in a class's
    (``benchmarks/pattern_counts.py --grid``); ``patternProperties`` names, which xgrammar
    still converts, keep the quadratic budget. Costly patterns are a ValueError naming the
    pattern's place, before anything converts them; the ones below the budgets pass."""
    with pytest.raises(ValueError, match="repeat") as err:
        validate(StructuredOutputsParams(json=schema))
    assert where in str(err.value) and "maxLength" in str(err.value)


def test_patterns_within_the_budgets_are_taken():
    """The patterns below the budgets of ``test_patterns_too_costly_to_convert_are_refused``
    convert (each in well under a second here)."""
    refused = []
    for fine in ({"type": "string", "pattern": "^[a-z]{1,6000}$"},  # refused before
                 {"type": "string", "pattern": "^.{1,1000000}$"},
                 {"type": "string", "pattern": "^(ab){1,50000}$"},
                 {"type": "string", "pattern": "^" + "a{1,1000}" * 9 + "$"},
                 {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}\{1000000\}$"},  # literal
                 {"type": "object", "patternProperties": {"^k{1,3000}$": {"type": "integer"}}},
                 {"type": "string", "maxLength": 10**6}):
        try:
            validate(StructuredOutputsParams(json=fine))
        except ValueError as refusal:
            refused.append((fine, str(refusal)))
    assert refused == []  # before the measured budgets: [a-z]{1,6000} was refused


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the byte each token character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


@pytest.mark.parametrize("kind", [
    {"json": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"]}},
    {"json": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}},
    {"json_object": True}, {"regex": r'[^"]{1,3}'}, {"regex": r"x.{1,3}"}])
def test_outputs_hold_no_surrogates(llm, kind):
    """xgrammar 0.2.9's JSON string characters include the surrogates U+D800-U+DFFF, whose
    UTF-8-like spelling ED A0-BF xx is not UTF-8: with the byte tokens ED and B1 favoured the
    output held ED B1 xx, which decodes to three U+FFFD (a maxLength 4 string read as 6 and
    more characters: seen on a LoRA server under mixed load). Regexes: xgrammar's ".",
    negated classes, \\D \\W \\S matched them too. The backend leaves them out."""
    tok = llm.get_tokenizer()
    lead, cont = tok.convert_tokens_to_ids(["í", "±"])  # the byte-level tokens of ED and B1
    assert tok.decode([lead]) == "\ufffd" and bytes([0xED]).decode("latin-1") == "í"
    params = [SamplingParams(temperature=0, max_tokens=24, logit_bias={lead: 8.0, cont: 30.0},
                             structured_outputs=StructuredOutputsParams(**kind))]
    (out,) = _run(llm, params, PROMPTS[:1])
    byte_of = _byte_of_char()
    raw = bytes(byte_of[ch] for t in out.token_ids if t != tok.eos_token_id
                for ch in tok.convert_ids_to_tokens(t))
    assert lead in out.token_ids and cont in out.token_ids, out.text  # the bias took effect
    # strict UTF-8 (a surrogate raises); a cut output may end inside a character
    codecs.getincrementaldecoder("utf-8")().decode(raw, final=out.finish_reason == "stop")
    if out.finish_reason == "stop":
        if "regex" in kind:
            assert re.fullmatch(kind["regex"], out.text), out.text
            return
        value = json.loads(out.text)
        if "json" in kind:
            jsonschema.validate(value, kind["json"])
