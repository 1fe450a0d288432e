"""A grammar in Lark's syntax (``start: "yes" | "no"``, which vLLM converts) is converted to
GBNF when it stays in the subset ``kvflow/structured/lark_grammar.py`` reads (session 29; it
was a 400); one outside it is refused with the construct and line and a sentence saying
kvflow reads GBNF / EBNF rules (``root ::= ...``). EBNF errors get no such sentence."""

from __future__ import annotations

import pytest

from kvflow.structured import StructuredOutputsParams, validate

HINT = (" (this looks like a Lark grammar, rules written 'name: ...'; kvflow reads GBNF / "
        "EBNF, rules written 'name ::= ...' with 'root' the start rule, and converts Lark's "
        "rules, literals, groups and quantifiers only)")


@pytest.mark.parametrize("grammar", ['start: "yes" | "no"', '?start: value\nvalue: "a"'])
def test_lark_grammar_in_the_subset_is_accepted(grammar):
    validate(StructuredOutputsParams(grammar=grammar))  # raises on failure


@pytest.mark.parametrize("grammar, why", [
    ("start: WORD\n%import common.WORD",
     "line 2: %import is not supported; write the imported rules out"),
    ('?start: value\nvalue: /[a-z]+/', ("line 2: regular-expression terminals (/.../) are not "
     "supported; write them as GBNF character classes")),
])
def test_lark_grammar_outside_the_subset_is_named(grammar, why):
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar=grammar))
    assert str(info.value) == f"invalid grammar in structured_outputs: Lark grammar {why}{HINT}"


def test_an_ebnf_error_gets_no_lark_sentence():
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar='root ::= "yes" |'))
    assert "Lark" not in str(info.value)
    assert str(info.value).endswith("but got the end of the grammar")
