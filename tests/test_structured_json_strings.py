"""JSON strings hold no raw control character (RFC 8259 s.7: U+0000-U+001F must be escaped),
whichever converter path wrote the string rule: a ``json`` constraint, a legacy structural
tag's schema, a ``format`` structural tag's ``json_schema`` (a tool call's parameters, JSON
style, and a JSON value nested in an XML-style parameter), for plain strings, length-limited
ones (``minLength`` / ``maxLength``, ``propertyNames``) and ``format`` ones.

xgrammar 0.2.9 writes a length-limited string's characters as ``[^"\\\r\n]``, which takes a
raw tab or \x01; kvflow narrowed it for ``json`` constraints and legacy tags only, so a
``format`` tag's ``minLength`` string let \x01 through and its output did not ``json.loads``.
The oracle: ``json.loads`` (strict, as RFC 8259) and ``jsonschema`` on the decoded value.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from tests.test_structured_counts import _tag as format_tag

LENGTH = {"type": "string", "minLength": 1, "maxLength": 8}


@pytest.fixture(scope="module")
def backend(tiny_llama):
    from transformers import AutoTokenizer

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _object(value: dict) -> dict:
    return {"type": "object", "properties": {"s": value}, "required": ["s"]}


def _legacy_tag(schema: dict) -> str:
    return json.dumps({"structures": [{"begin": "<t>", "schema": schema, "end": "</t>"}],
                       "triggers": ["<t>"]})


# (id, constraint for the schema {"s": <value schema>}, the JSON text of the object -> bytes)
PATHS = [
    ("json", lambda s: StructuredOutputsParams(json=_object(s)), lambda b: b'{"s": ' + b + b"}"),
    ("legacy_tag", lambda s: StructuredOutputsParams(structural_tag=_legacy_tag(_object(s))),
     lambda b: b'<t>{"s": ' + b + b"}</t>"),
    ("format_tag", lambda s: StructuredOutputsParams(structural_tag=format_tag(_object(s))),
     lambda b: b'<t>{"s": ' + b + b"}</t>"),
    ("format_tag_xml_nested", lambda s: StructuredOutputsParams(structural_tag=format_tag(
        _object({"type": "array", "items": s}), "qwen_xml")),
     lambda b: b"<t><parameter=s>\n[" + b + b"]\n</parameter>\n</t>"),
]


def _accepts(backend, params: StructuredOutputsParams, data: bytes) -> bool:
    matcher = xgr.GrammarMatcher(backend.compile(params), terminate_without_stop_token=True)
    return matcher.accept_string(data) and matcher.is_terminated()


def _json_string(data: bytes) -> bool:
    """The oracle: whether ``data`` is one JSON string (strict: no raw control character)."""
    try:
        return isinstance(json.loads(data.decode("utf-8")), str)
    except ValueError:
        return False


@pytest.mark.parametrize("path, params, text", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("control", [b"\x01", b"\t", b"\x1f", b"\x00"],
                         ids=["x01", "tab", "x1f", "nul"])
def test_length_limited_strings_refuse_raw_control_characters(backend, path, params, text,
                                                              control):
    good, bad = b'"ab"', b'"a' + control + b'b"'
    assert _json_string(good) and not _json_string(bad)
    assert _accepts(backend, params(LENGTH), text(good))
    assert not _accepts(backend, params(LENGTH), text(bad))


@pytest.mark.parametrize("path, params, text", PATHS, ids=[p[0] for p in PATHS])
def test_plain_strings_take_escapes_not_raw_control_characters(backend, path, params, text):
    """A string without a length limit takes every escape JSON has (``\\u0001``, ``\\n``),
    which decode to the control character, and refuses the raw character."""
    for good in (b'"a\\u0001b"', b'"a\\nb"', b'"\\u001f\\t"'):
        assert _json_string(good)
        assert _accepts(backend, params({"type": "string"}), text(good)), good
    assert not _accepts(backend, params({"type": "string"}), text(b'"a\x01b"'))


def test_length_limited_strings_take_valid_values_without_escapes(backend):
    """minLength / maxLength strings take no JSON escape (a documented limitation: written
    with escapes, xgrammar filled masks 1,000-20,000 times slower; docs/structured-output.md),
    so a value holding ``"``, ``\\`` or a control character cannot be written, and one
    spelled with an escape (``\\u0041``) is refused; every string taken validates against
    the schema (jsonschema, the oracle: lengths in code points, a non-BMP character one).
    Checked over every string of up to 5 characters of a small alphabet."""
    import itertools

    import jsonschema

    schema = {"type": "string", "minLength": 2, "maxLength": 4}
    compiled = backend.compile(StructuredOutputsParams(json=schema))

    def takes(data: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(data) and matcher.is_terminated()
    for n in range(6):
        for chars in itertools.product('a"\\\né😀', repeat=n):
            value = "".join(chars)
            data = json.dumps(value, ensure_ascii=False).encode()
            needs_escape = any(c in value for c in '"\\\n')
            assert takes(data) == (2 <= n <= 4 and not needs_escape), value
            if takes(data):
                jsonschema.validate(json.loads(data), schema)
    assert jsonschema.Draft202012Validator(schema).is_valid("Abc")
    assert takes(b'"Abc"') and not takes(b'"\\u0041bc"')


def test_property_name_lengths_refuse_raw_control_characters(backend):
    schema = {"type": "object", "propertyNames": {"maxLength": 3}}
    params = StructuredOutputsParams(json=schema)
    assert _accepts(backend, params, b'{"ab": 1}')
    assert not _accepts(backend, params, b'{"a\x01": 1}')


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, num_kv_blocks=64, block_size=16)


def test_format_tag_length_limited_outputs_parse(llm):
    """Sampled hot from the tiny random model (whose byte tokens include the control
    characters; a ``format`` tag's JSON takes any whitespace, so some run to ``max_tokens``),
    every finished structure's JSON loads and meets the schema."""
    schema = _object({"type": "string", "minLength": 3, "maxLength": 5})
    tag = format_tag(schema)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(structural_tag=tag))
              for i in range(12)]
    outs = [o.outputs[0] for o in llm.generate(["a b a b"] * 12, params, use_tqdm=False)]
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6, [o.text for o in outs]
    for o in stopped:
        assert o.text.startswith("<t>") and o.text.endswith("</t>"), o.text
        jsonschema.validate(json.loads(o.text[len("<t>"):-len("</t>")]), schema)


@pytest.mark.parametrize("style", [None, "qwen_xml"])
def test_format_tag_arrays_without_items_take_any_items(backend, style):
    """A ``format`` tag's schema gets the same ``"items": true`` as a ``json`` constraint's
    (``xgrammar_convert.open_arrays``): xgrammar took only ``[]`` for ``maxItems`` 3."""
    schema = _object({"type": "array", "maxItems": 3})
    params = StructuredOutputsParams(structural_tag=format_tag(schema, style))
    text = (b'<t>{"s": ' + b"%s" + b"}</t>") if style is None else \
        b"<t><parameter=s>\n%s\n</parameter>\n</t>"
    assert _accepts(backend, params, text % b'[1, "a"]')
    assert not _accepts(backend, params, text % b"[1, 2, 3, 4]")
