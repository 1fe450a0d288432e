"""A tool without ``parameters`` takes no arguments (OpenAI: omitting parameters defines a
function with an empty parameter list). Under tool_choice ``required`` or naming it, the
grammar let the model make arguments up (``{"a": 10}``: the any-object schema); now its
arguments can only be ``{}``. Oracles: jsonschema and xgrammar's own matcher on the schema
kvflow builds; ``parameters: {}`` and a real schema keep their meaning."""

from __future__ import annotations

import json

import jsonschema
import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.structured_requests import tool_constraint
from kvflow.structured import validate

HI = [{"role": "user", "content": "hi"}]
BARE = {"type": "function", "function": {"name": "ping"}}  # no parameters
ANY = {"type": "function", "function": {"name": "anything", "parameters": {}}}
TYPED = {"type": "function", "function": {"name": "get_x", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


def _schema(tools: list[dict], choice) -> dict:
    """The JSON schema of the forced-call grammar kvflow builds (compiled: it must pass)."""
    req = ChatCompletionRequest(messages=HI, tools=tools, tool_choice=choice)
    mode = "required" if choice == "required" else "named"
    constraint = tool_constraint(req, mode)
    validate(constraint)
    return json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json


def _accepts(schema: dict, text: str) -> tuple[bool, bool]:
    """(jsonschema's verdict, xgrammar's verdict) on ``text`` for ``schema``."""
    grammar = Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return (jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)),
            _is_grammar_accept_string(grammar, text))


NAMED = {"type": "function", "function": {"name": "ping"}}


@pytest.mark.parametrize("tools, choice, empty, made_up", [
    ([BARE], NAMED, "{}", '{"a": 10}'),
    ([BARE], "required", '[{"name": "ping", "arguments": {}}]',
     '[{"name": "ping", "arguments": {"a": 10}}]'),
    ([TYPED, BARE], "required", '[{"name": "ping", "arguments": {}}]',
     '[{"name": "ping", "arguments": {"a": 10}}]'),
], ids=["named", "required", "required_among_others"])
def test_no_parameters_allows_only_empty_arguments(tools, choice, empty, made_up):
    schema = _schema(tools, choice)
    assert _accepts(schema, empty) == (True, True)
    assert _accepts(schema, made_up) == (False, False)


def test_other_tools_keep_their_arguments():
    """``parameters: {}`` is any object (as before), a typed schema its own arguments."""
    schema = _schema([ANY, TYPED], "required")
    assert _accepts(schema, '[{"name": "anything", "arguments": {"a": 10}}]') == (True, True)
    assert _accepts(schema, '[{"name": "get_x", "arguments": {"x": 3}}]') == (True, True)
    assert _accepts(schema, '[{"name": "get_x", "arguments": {}}]') == (False, False)
