"""An EBNF grammar (``structured_outputs.grammar``, vLLM's ``guided_grammar``) that does not
parse is refused with a message that says where (line, column in characters, the grammar
text just before it), what was expected there and what the grammar has instead. xgrammar's
own text ended in an empty "... but got" at the end of the grammar (and counts columns in
UTF-8 bytes); the expectations below are hand-written from the grammars."""

from __future__ import annotations

import pytest

from kvflow.structured import StructuredOutputsParams, validate
from kvflow.structured.xgrammar_errors import grammar_error

ELEMENT = ('an element (a "quoted string", a [character class], a rule name or a '
           '(parenthesized group))')
PREFIX = "invalid grammar in structured_outputs: "


@pytest.mark.parametrize("grammar, expected", [
    # a trailing "|": nothing after it; xgrammar reports line 2, column 1
    ('root ::= "a" |\n', (f"line 2, column 1 (after 'root ::= \"a\" |'): expected {ELEMENT}, "
                         "but got the end of the grammar")),
    ('root ::= ', (f"line 1, column 10 (after 'root ::='): expected {ELEMENT}, but got the "
                  "end of the grammar")),
    # the empty alternative runs into the next rule's name
    ('root ::= "a" |\nx ::= "b"', (f"line 2, column 1 (after 'root ::= \"a\" |'): expected "
                                  f"{ELEMENT}, but got 'x'")),
    ('root ::= "a"*+', (f"line 1, column 14 (after 'root ::= \"a\"*'): expected {ELEMENT}, "
                       "but got '+'")),
    # "é" is two UTF-8 bytes: column 19 in characters (xgrammar says 20)
    ('root ::= "é" "b" |', (f"line 1, column 19 (after 'root ::= \"é\" \"b\" |'): expected "
                          f"{ELEMENT}, but got the end of the grammar")),
    ('root ::= ("a"', ("line 1, column 14 (after 'root ::= (\"a\"'): expected ')', but got "
                      "the end of the grammar")),
    ('root ::= ("a" "b"\nx ::= "c"', ("line 2, column 1 (after 'root ::= (\"a\" \"b\"'): "
                                    "expected ')', but got 'x'")),
    # other messages keep xgrammar's words, with the place added
    ('root ::= foo', "line 1, column 10 (after 'root ::='): Rule \"foo\" is not defined"),
    ('rot ::= "a"', 'line 1, column 1: The root rule with name "root" is not found'),
])
def test_bad_grammar_message_says_where_and_what(grammar, expected):
    with pytest.raises(ValueError) as e:
        validate(StructuredOutputsParams(grammar=grammar))
    assert str(e.value) == PREFIX + expected
    assert not str(e.value).rstrip().endswith("but got")


def test_other_messages_pass_unchanged():
    """A message not in xgrammar's EBNF-error shape is returned as given."""
    assert grammar_error('root ::= "a"', "something else failed") == "something else failed"


def test_served_guided_grammar_400_is_complete(tiny_tokenizer):
    """Over HTTP (the chat handler's SamplingParams step, in-process): a 400 naming
    ``guided_grammar``, in the message too, with the whole message (was "... Expect element,
    but got")."""
    from types import SimpleNamespace

    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.sampling_requests import sampling_params
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(processor=InputProcessor(tiny_tokenizer, 64, 320, 0))
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}],
        "guided_grammar": 'root ::= "yes" | "no" |'})
    with pytest.raises(OpenAIError) as e:
        sampling_params(engine, req, 4, None)
    assert e.value.status == 400
    assert e.value.body()["error"] == {
        "message": "invalid grammar in guided_grammar: "  # the field sent, not the engine's
                   f"line 1, column 24 (after 'root ::= \"yes\" | \"no\" |'): expected "
                   f"{ELEMENT}, but got the end of the grammar",
        "type": "invalid_request_error", "param": "guided_grammar", "code": "invalid_value"}
