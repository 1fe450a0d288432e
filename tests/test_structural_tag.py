"""Structural tags (``StructuredOutputsParams(structural_tag=...)``, vLLM's legacy
``structures`` + ``triggers`` spelling and xgrammar's ``format`` one) on the tiny random model.

Oracles: xgrammar's own ``GrammarMatcher``, compiled from the legacy tag through xgrammar's
own (deprecated) legacy API - not kvflow's conversion - accepts every output's token ids
(and the EOS of a finished one); each structure in the text parses as JSON valid for its
schema (``jsonschema``), and every trigger in the text begins a structure (hand check);
greedy output equals transformers' greedy decoding with xgrammar's mask applied to its
logits. The trigger is a single letter of the tiny tokenizer's byte-level vocabulary, so hot
sampling meets it within a few tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams, validate

DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                               "maximum": 9}}, "required": ["n"]}
WORD = {"enum": ["ok", "no"]}  # neither has the trigger letter
TAG = {"type": "structural_tag", "triggers": ["e"],
       "structures": [{"begin": "e<a>", "schema": DIGIT, "end": "</a>"},
                      {"begin": "e<b>", "schema": WORD, "end": "</b>"}]}
STRUCTURE = re.compile(r"e<(a|b)>(.*?)</\1>", re.DOTALL)
PROMPT = "the quick brown fox"
CYCLE = 'root ::= "a" b\nb ::= b{1,2}'


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=16)


def _legacy_matcher(tokenizer, vocab_size: int, tag: dict) -> xgr.GrammarMatcher:
    """xgrammar's matcher for a legacy tag, built with xgrammar's own legacy API."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                   end=s["end"]) for s in tag["structures"]]
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(items, tag["triggers"])
    return xgr.GrammarMatcher(compiled)


def _assert_follows_tag(out, matcher: xgr.GrammarMatcher, eos: int) -> int:
    """The oracle checks on one output (the matcher ends exactly when the output ended
    with the EOS); returns its number of complete structures."""
    matcher.reset()
    for token in out.token_ids:  # a finished output's last token is the EOS
        assert matcher.accept_token(token), (out.text, token)
    assert matcher.is_terminated() == (out.finish_reason == "stop"), out.text
    assert (out.token_ids[-1] == eos) == (out.finish_reason == "stop")
    structures = STRUCTURE.findall(out.text)
    for name, body in structures:
        jsonschema.validate(json.loads(body), DIGIT if name == "a" else WORD)
    # outside structures no trigger may stand alone; a cut output may end inside one
    complete = STRUCTURE.sub("", out.text)
    assert complete.count("e") <= (out.finish_reason == "length"), out.text
    return len(structures)


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "json_text"])
def test_sampled_outputs_follow_the_tag(llm, tiny_llama, tiny_tokenizer, as_text):
    """Hot sampling, fixed seeds: the trigger letter comes up often, and each time the
    output goes on with one structure; xgrammar's matcher accepts every output. The JSON
    text spelling (vLLM's) gives the same outputs as the dict."""
    tag = json.dumps(TAG) if as_text else TAG
    params = [SamplingParams(temperature=1.5, seed=seed, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(structural_tag=tag))
              for seed in range(16)]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 16, params, use_tqdm=False)]
    matcher = _legacy_matcher(tiny_tokenizer, tiny_llama.vocab_size, TAG)
    counts = [_assert_follows_tag(o, matcher, tiny_tokenizer.eos_token_id) for o in outs]
    assert sum(c > 0 for c in counts) >= 4, ([o.text for o in outs], counts)
    assert {n for o in outs for n, _ in STRUCTURE.findall(o.text)} == {"a", "b"}
    unconstrained = llm.generate([PROMPT] * 8, [SamplingParams(temperature=1.5, seed=s,
                                                               max_tokens=40)
                                                for s in range(8)], use_tqdm=False)
    assert [o.outputs[0].text for o in unconstrained] != [o.text for o in outs]


def _masked_greedy(hf, matcher: xgr.GrammarMatcher, prompt: list[int], max_tokens: int
                   ) -> list[int]:
    """transformers' greedy decoding, each step's logits masked by xgrammar's bitmask
    (unpacked with plain torch bit operations)."""
    vocab = hf.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt), []
    while len(out) < max_tokens and not matcher.is_terminated():
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        logits[~bits.bool().flatten()[:vocab]] = float("-inf")
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        ids.append(token)
        out.append(token)
    return out


def test_greedy_matches_transformers_with_xgrammar_mask(llm, tiny_llama, tiny_tokenizer):
    """The trigger is a word the unconstrained greedy text writes early, so the greedy
    constrained output meets it; kvflow's tokens equal the masked transformers reference.
    Schemas without whitespace choices (an integer, an enum), so xgrammar's legacy grammar
    (any whitespace in JSON) and kvflow's (compact) allow the same tokens."""
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    trigger = next(text for text in map(tiny_tokenizer.decode, ([t] for t in free.token_ids))
                   if text.isalnum())
    tag = {"type": "structural_tag", "triggers": [trigger],
           "structures": [{"begin": trigger + "[", "schema": {"type": "integer"}, "end": "]"},
                          {"begin": trigger + "=", "schema": WORD, "end": ";"}]}
    params = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(structural_tag=tag))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    matcher = _legacy_matcher(tiny_tokenizer, tiny_llama.vocab_size, tag)
    expected = _masked_greedy(tiny_llama.hf_model, matcher, out.prompt_token_ids, 30)
    assert list(out.outputs[0].token_ids) == expected
    ended = expected[-1] == tiny_tokenizer.eos_token_id
    assert out.outputs[0].finish_reason == ("stop" if ended else "length")
    assert trigger + "[" in out.outputs[0].text or trigger + "=" in out.outputs[0].text


def test_format_spelling(llm, tiny_llama, tiny_tokenizer):
    """xgrammar's newer ``format`` spelling, passed through: a ``triggered_tags`` that must
    produce at least one tag and stops after the first, the tag's content a regex; every
    output is one ``e<r>`` structure whose body matches, after free text without the
    trigger letter."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["e"], "at_least_one": True,
        "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "e<r>", "end": "</r>",
                  "content": {"type": "regex", "pattern": "[0-9]{2}"}}]}}
    params = [SamplingParams(temperature=1.5, seed=seed, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(structural_tag=tag))
              for seed in range(4)]
    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer, vocab_size=tiny_llama.vocab_size,
                                              stop_token_ids=[tiny_tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag))
    finished = 0
    for out in llm.generate([PROMPT] * 4, params, use_tqdm=False):
        o = out.outputs[0]
        matcher.reset()
        assert all(matcher.accept_token(t) for t in o.token_ids), o.text
        if o.finish_reason == "stop":
            finished += 1
            assert re.fullmatch(r"[^e]*e<r>[0-9]{2}</r>", o.text, re.DOTALL), o.text
    assert finished >= 2


@pytest.mark.parametrize("tag, needle", [
    ({"structures": TAG["structures"]}, "triggers: missing"),
    ({"triggers": ["e"]}, "structures: missing"),
    ({**TAG, "triggers": ["<f"]}, "structures.0.begin: 'e<a>' starts with none of"),
    ({**TAG, "triggers": ["e", "<g"]}, "triggers.1: the trigger '<g' starts no begin"),
    ({**TAG, "structures": [{"begin": "e", "schema": {"type": "frob"}, "end": ""}]},
     'structures.0.schema: Unsupported type "frob"'),
    ({**TAG, "structures": [{"begin": "e", "schema": {"type": "array", "uniqueItems": True},
                             "end": ""}]}, "structures.0.schema: 'uniqueItems'"),
    ({**TAG, "structures": [{"begin": "e", "end": ""}]}, "structures.0.schema: missing"),
    ({**TAG, "strucutres": []}, "strucutres: unknown field"),
    ({"type": "structural_tag", "format": {"type": "frob"}}, "not recognized: frob"),
    ({"type": "structural_tag", "format": {"type": "json_schema",
                                           "json_schema": {"not": {}}}},
     "format.json_schema: 'not'"),
    # no text matches: the reply stopped after "ab" (length) before regex_empty refused them
    ({"type": "structural_tag", "format": {"type": "regex", "pattern": "ab[^\\s\\S]"}},
     "format.pattern: matches no string"),
    ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "string", "pattern": "ab[^\\s\\S]"}}},
     "format.json_schema: the pattern 'ab[^\\\\s\\\\S]' at pattern matches no string"),
    # a rule defined only as itself crashes xgrammar's compiler (segfault): refused first,
    # also beside a token format (which validate, without the tokenizer, cannot convert)
    ({"type": "structural_tag", "format": {"type": "grammar", "grammar": CYCLE}},
     "rule 'b' is defined only as itself"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "<eos>"}, {"type": "grammar", "grammar": CYCLE}]}},
     "rule 'b' is defined only as itself"),
    ("{nope", "not valid JSON"),
    ('["e"]', "must be a JSON object"),
])
def test_bad_tags_raise_naming_the_field(llm, tag, needle):
    params = StructuredOutputsParams(structural_tag=tag)
    with pytest.raises(ValueError, match="invalid structural tag") as info:
        validate(params)
    assert needle in str(info.value)
    with pytest.raises(ValueError, match=re.escape(needle)):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=params),
                     use_tqdm=False)


def test_params_type_and_one_constraint_only():
    with pytest.raises(ValueError, match="exactly one of .*structural_tag"):
        StructuredOutputsParams(regex="a", structural_tag=TAG)
    with pytest.raises(ValueError, match="structural_tag must be a structural tag"):
        StructuredOutputsParams(structural_tag=["e"])
    params = SamplingParams(structured_outputs={"structural_tag": TAG})
    assert params.structured_outputs.kind == "structural_tag"
    assert json.loads(params.structured_outputs.key[1]) == TAG


@pytest.mark.parametrize("response_format, param", [
    ({"type": "structural_tag", "structures": TAG["structures"]}, "response_format.triggers"),
    ({"type": "structural_tag", "triggers": ["e"]}, "response_format.structures"),
    ({**TAG, "triggers": ["<"]}, "response_format.structures.0.begin"),
    ({**TAG, "format": {"type": "any_text"}}, "response_format.format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": DIGIT},
      "structures": TAG["structures"]}, "response_format.structures"),
    ({"type": "text", "format": {"type": "any_text"}}, "response_format.format"),
])
def test_request_errors_name_the_field(response_format, param):
    """The server's reading of response_format: each malformed structural tag is refused
    before anything compiles, naming the field of the request body."""
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.structured_requests import RequestFieldError, request_constraint

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                response_format=response_format)
    with pytest.raises(RequestFieldError) as info:
        request_constraint(req)
    assert info.value.param == param


def test_schema_compile_errors_name_the_structure():
    """A schema that does not compile: the 400 names response_format.structures.N.schema
    (from the field path in the compile check's error); in structured_outputs' JSON text the
    param is the text's field and the message holds the inner path."""
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.sampling_requests import _params_error
    from kvflow.entrypoints.structured_requests import request_constraint

    bad = {**TAG, "structures": [TAG["structures"][0],
                                 {"begin": "e<c>", "schema": {"type": "frob"}, "end": "</c>"}]}
    messages = [{"role": "user", "content": "hi"}]
    for body, param in [({"response_format": bad}, "response_format.structures.1.schema"),
                        ({"structured_outputs": {"structural_tag": json.dumps(bad)}},
                         "structured_outputs.structural_tag")]:
        req = ChatCompletionRequest(messages=messages, **body)
        with pytest.raises(ValueError) as info:
            validate(request_constraint(req))
        error = _params_error(info.value, req, None)
        assert (error.param, error.status) == (param, 400), error.param
        assert "structures.1.schema: Unsupported type \"frob\"" in str(error)


def test_token_formats_compile_with_the_tokenizer(llm, tiny_tokenizer):
    """A ``format`` naming a token id (checked only when compiled with the tokenizer):
    the output is the constant string, then exactly that token."""
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "ok "}, {"type": "token", "token": 300}]}}
    validate(StructuredOutputsParams(structural_tag=tag))
    params = SamplingParams(temperature=1.5, seed=0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(structural_tag=tag))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-2:] == [300, tiny_tokenizer.eos_token_id]
    assert tiny_tokenizer.decode(out.token_ids[:-2]) == "ok "
    bad = {"type": "structural_tag", "format": {"type": "token", "token": 10**6}}
    with pytest.raises(ValueError, match=r"invalid structural tag in structured_outputs: "
                                         r"Check failed: .*Token id 1000000 .* out of the "):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=(
            StructuredOutputsParams(structural_tag=bad))), use_tqdm=False)


def test_regex_formats_read_as_regex_constraints(llm):
    """A ``regex`` format's ``.`` took a newline (xgrammar's dialect): with the newline token
    favoured, ``x.y`` inside the tag gave ``x\\ny``. Its pattern is now sent as a ``regex``
    constraint's is (``.`` as ``[^\\n]``), and an anchor xgrammar reads as a letter is refused
    naming the field."""
    (newline,) = llm.get_tokenizer().encode("\n")
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<r>", "content": {"type": "regex", "pattern": "x.y"},
        "end": "</r>"}}
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias={newline: 30.0},
                            structured_outputs=StructuredOutputsParams(structural_tag=tag))
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"<r>x.y</r>", out.text), out.text
    tag["format"]["content"]["pattern"] = r"x\Z"
    with pytest.raises(ValueError, match=r"format\.content\.pattern: \\Z at position 1 is read "
                                         r"as the letter 'Z'"):
        validate(StructuredOutputsParams(structural_tag=tag))
