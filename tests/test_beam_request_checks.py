"""``check_beam_request``'s refusals name the field the request sent: a number, bool or short
string with its value, a schema, a ``structured_outputs`` object, a long grammar or a list of
token ids by the name alone (they printed their whole repr, ``structured_outputs`` as
``StructuredOutputsField(json_=None, ...)``, the model's Python field names)."""

from __future__ import annotations

import pytest

from kvflow.entrypoints.beam_requests import check_beam_request
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
GRAMMAR = 'root ::= "yes" | "no" | "maybe" | "perhaps" | "certainly not"'


@pytest.mark.parametrize("field,value,message", [
    ("structured_outputs", {"regex": "[a-z]+"}, "structured_outputs cannot be used"),
    ("guided_json", SCHEMA, "guided_json cannot be used"),
    ("guided_grammar", GRAMMAR, "guided_grammar cannot be used"),
    ("allowed_token_ids", list(range(5000)), "allowed_token_ids cannot be used"),
    ("logit_bias", {"5": 10}, "logit_bias cannot be used"),
    ("guided_regex", "[a-z]+", "guided_regex='[a-z]+' cannot be used"),
    ("temperature", 0.7, "temperature=0.7 cannot be used"),
    ("min_tokens", 2, "min_tokens=2 cannot be used"),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_refusal_names_the_field(route, field, value, message):
    base = {"prompt": "a"} if route == "completions" else \
        {"messages": [{"role": "user", "content": "a"}]}
    model = CompletionRequest if route == "completions" else ChatCompletionRequest
    req = model.model_validate({**base, "use_beam_search": True, "n": 2, field: value})
    with pytest.raises(OpenAIError) as caught:
        check_beam_request(req)
    text = str(caught.value)
    assert caught.value.param == field
    assert text.startswith(message), text
    assert "StructuredOutputsField" not in text and "4999" not in text and \
        "certainly" not in text and len(text) < 200, text
