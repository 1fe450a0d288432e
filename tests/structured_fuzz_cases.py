"""Grammar kinds for the structured-output fuzz (``tests/test_structured_fuzz.py``), each with
an oracle that does not use xgrammar: ``json.loads`` + ``jsonschema`` (formats checked), Python's
``re.fullmatch``, Lark's Earley parser, string equality. Among them the edge cases vLLM users
hit: the empty schema, non-ASCII ``enum``, ``const``, a long ``pattern``, recursive ``$ref``,
``additionalProperties: false`` with ``required``, ``minItems`` / ``maxItems``, overlapping
choices, regex anchors, and the classes that matched UTF-16 surrogates (``.``, ``[^...]``,
``\\D`` / ``\\W`` / ``\\S``, also inside classes, patterns and tags)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import lark
import regex as partial_regex


@dataclass(frozen=True)
class FuzzCase:
    """One constraint and its oracles.

    Attributes:
        name: the test id.
        constraint: ``StructuredOutputsParams`` keyword arguments (``json=...``, ``regex=...``).
        check: raises AssertionError unless a finished (``stop``) output's text is accepted.
        is_prefix: whether a cut (``length``) output's text can still be completed; None
            where no oracle says (JSON: checked for UTF-8 only).
        open_ended: whether a random model may well never finish within the fuzz's
            max_tokens (a free string); the others must finish at least once.
    """

    name: str
    constraint: dict[str, Any]
    check: Callable[[str], None]
    is_prefix: Callable[[str], bool] | None = None
    open_ended: bool = False


def _json_case(name: str, schema: Any, open_ended: bool = False,
               check_string: Callable[[str], None] | None = None) -> FuzzCase:
    """``check_string``: the oracle of the value's ``s`` (checked instead of its schema's)."""
    def check(text: str) -> None:
        value = json.loads(text)
        if check_string is not None:
            check_string(value.pop("s"))
            return
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return FuzzCase(name, {"json": schema}, check, open_ended=open_ended)


def _regex_case(name: str, pattern: str, flags: int = 0) -> FuzzCase:
    """``flags``: ``re.ASCII`` where the pattern has ``\\d`` / ``\\w``, which xgrammar (as
    JavaScript, RE2, PCRE) reads as ASCII, Python's ``re`` as Unicode."""
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text, flags), (pattern, text)
    return FuzzCase(name, {"regex": pattern}, check,
                    lambda text: partial_regex.fullmatch(pattern, text, flags, partial=True)
                    is not None)


def _lark_case(name: str, grammar: str, constraint: dict[str, Any] | None = None) -> FuzzCase:
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")

    def check(text: str) -> None:
        parser.parse(text)
    return FuzzCase(name, constraint or {"grammar": grammar}, check)


def _choice_case(name: str, choices: list[str]) -> FuzzCase:
    def check(text: str) -> None:
        assert text in choices, (text, choices)
    return FuzzCase(name, {"choice": choices}, check,
                    lambda text: any(c.startswith(text) for c in choices))


def _tag_case(name: str, content: dict[str, Any], inner: Callable[[str], None],
              open_ended: bool = False) -> FuzzCase:
    """A structural tag whose whole output is ``<t>`` content ``</t>``."""
    tag = {"type": "structural_tag",
           "format": {"type": "tag", "begin": "<t>", "content": content, "end": "</t>"}}

    def check(text: str) -> None:
        assert text.startswith("<t>") and text.endswith("</t>"), text
        inner(text[3:-4])
    return FuzzCase(name, {"structural_tag": json.dumps(tag)}, check, open_ended=open_ended)


def _object(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), **extra}


_TREE = {"$defs": {"node": _object({"v": {"type": "integer"},
                                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                             "maxItems": 2}}, additionalProperties=False)},
         "$ref": "#/$defs/node"}
_WORDS = [f"w{i:03d}x" for i in range(300)]  # a 2,100-character pattern
_LONG_PATTERN = "^(" + "|".join(_WORDS) + ")$"
_STRING = {"type": "string"}


def _valid_json(text: str) -> None:
    json.loads(text)


CASES = [
    _json_case("empty_schema", {}),
    _json_case("enum_non_ascii", {"enum": ["café", "日本語", "naïve", "Ünïcödé 😀"]}),
    _json_case("const", {"const": {"k": ["ü", 1, None]}}),
    _json_case("long_pattern", {"type": "string", "pattern": _LONG_PATTERN}),
    _json_case("recursive_ref", _TREE),
    _json_case("closed_required", _object({"a": {"type": "integer"}, "b": _STRING},
                                          additionalProperties=False), open_ended=True),
    _json_case("min_max_items", {"type": "array", "items": {"type": "integer"},
                                 "minItems": 2, "maxItems": 4}),
    _json_case("string_any", _object({"s": _STRING}), open_ended=True),
    _json_case("string_length", _object({"s": {"type": "string", "minLength": 2,
                                               "maxLength": 5}})),
    _json_case("pattern_dot", _object({"s": {"type": "string", "pattern": "^x.{1,4}$"}})),
    _json_case("pattern_negated", _object({"s": {"type": "string",
                                                 "pattern": "^[^a-z]{1,4}$"}})),
    _json_case("pattern_shorthands", _object({"s": {"type": "string",
                                                    "pattern": r"^\D\W\S[\D\s]$"}}),
               check_string=lambda s: _check_regex(r"\D\W\S[\D\s]", s, re.ASCII)),
    _json_case("formats", _object({"d": {"type": "string", "format": "date"},
                                   "e": {"type": "string", "format": "email"}}),
               open_ended=True),
    _json_case("ipv4", {"type": "string", "format": "ipv4"}),
    # counts past 32 (repeat_counts): blocks, chains, a quote; a random model seldom ends
    # these within max_tokens, so most outputs are cut (checked for UTF-8)
    _json_case("pattern_large_count", _object({"s": {"type": "string",
                                                     "pattern": "^[^a-z]{33,200}$"}}),
               open_ended=True),
    _json_case("pattern_large_count_quote", _object({"s": {"type": "string",
                                                           "pattern": '^"\\d{40,}$'}}),
               open_ended=True),
    _json_case("pattern_large_range", _object({"s": {"type": "string",
                                                     "pattern": "^x.{1,300}$"}}),
               open_ended=True),
    FuzzCase("json_object", {"json_object": True},
             lambda text: isinstance(json.loads(text), dict) or _fail(text)),
    _regex_case("regex_anchors", r"^[a-z]{2,5}\d$"),
    _regex_case("regex_dot", r"x.{1,3}"),
    _regex_case("regex_negated", r"<[^>]{1,6}>"),
    _regex_case("regex_shorthands", r"\W\D\S{1,3}", re.ASCII),
    _regex_case("regex_class_shorthands", r"[\D][\W][\S]{1,3}", re.ASCII),
    _regex_case("regex_wide_range", r"[\u0000-\uFFFF]{1,4}"),
    _choice_case("choice_prefixes", ["a", "ab", "abc", "b", "日本", "日"]),
    _lark_case("lark_words", 'start: WORD ("," WORD)*\n%import common.WORD'),
    _lark_case("lark_regex", "start: /[^ ]{1,5}/ (\" \" /\\S{1,3}/)*"),
    _lark_case("lark_dot", "start: /x.{1,4}/"),
    _lark_case("gbnf_negated", 'start: "<" /[^>]{1,8}/ ">"',
               {"grammar": 'root ::= "<" [^>]{1,8} ">"'}),  # bounded: it ends within max_tokens
    _tag_case("tag_json", {"type": "json_schema", "json_schema": _object({"s": _STRING})},
              _valid_json, open_ended=True),
    _tag_case("tag_json_pattern", {"type": "json_schema", "json_schema": _object(
        {"s": {"type": "string", "pattern": '^[^a]"{0,40}$'}})},
        lambda text: _check_regex('[^a]"{0,40}', json.loads(text)["s"]), open_ended=True),
    _tag_case("tag_regex", {"type": "regex", "pattern": r"[\D]{1,4}"},
              lambda text: _check_regex(r"[\D]{1,4}", text)),
    _tag_case("tag_grammar", {"type": "grammar", "grammar": 'root ::= [^<]{1,6}'},
              lambda text: _check_regex(r"[^<]{1,6}", text)),
]


def _check_regex(pattern: str, text: str, flags: int = 0) -> None:
    assert re.fullmatch(pattern, text, flags), (pattern, text)


def _fail(text: str) -> bool:
    raise AssertionError(text)
