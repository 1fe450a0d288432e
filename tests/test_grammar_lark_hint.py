"""A grammar in Lark's syntax (``start: "yes" | "no"``, which vLLM converts) is refused with a
sentence saying kvflow reads GBNF / EBNF rules (``root ::= ...``); the message was only
"Unexpected character: ':'" (newcomer check, session 29). EBNF errors get no such sentence."""

from __future__ import annotations

import pytest

from kvflow.structured import StructuredOutputsParams, validate

HINT = (" (this looks like a Lark grammar, rules written 'name: ...'; kvflow reads GBNF / "
        "EBNF, rules written 'name ::= ...' with 'root' the start rule)")


@pytest.mark.parametrize("grammar, where", [
    ('start: "yes" | "no"', "line 1, column 6 (after 'start')"),
    ('?start: value\nvalue: "a"', "line 1, column 7 (after '?start')"),
])
def test_lark_grammar_is_named(grammar, where):
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar=grammar))
    assert str(info.value) == (f"invalid grammar in structured_outputs: {where}: Unexpected "
                               f"character: ':'{HINT}")


def test_an_ebnf_error_gets_no_lark_sentence():
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar='root ::= "yes" |'))
    assert "Lark" not in str(info.value)
    assert str(info.value).endswith("but got the end of the grammar")
