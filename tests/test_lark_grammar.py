"""Lark grammars (``start: "yes" | "no"``, which vLLM accepts) are converted to the GBNF that
xgrammar reads (``kvflow/structured/lark_grammar.py``): exact converted text against GBNF
written by hand from Lark's grammar reference, xgrammar accepting it, a generation on the tiny
model whose output is one of the alternatives, and refusals naming the construct and line."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams, validate
from kvflow.structured.lark_grammar import lark_to_gbnf, looks_like_lark

HINT = (" (this looks like a Lark grammar, rules written 'name: ...'; kvflow reads GBNF / "
        "EBNF, rules written 'name ::= ...' with 'root' the start rule, and converts Lark's "
        "rules, literals, groups and quantifiers only)")

CONVERTED = [
    ('start: "yes" | "no"', 'root ::= "yes" | "no"'),
    ('?start: value\nvalue: "a"', 'root ::= value\nvalue ::= "a"'),
    (('// pairs\n?start: pair ("," pair)*  // more\n!pair: KEY ":" [VALUE]+\n'
     'KEY.2: "k" | "kk"\n\nVALUE: ("1"\n     | "2")?\n     | "3"'),
     ('root ::= pair ("," pair)*\npair ::= KEY ":" (VALUE)*\nKEY ::= "k" | "kk"\n'
     'VALUE ::= ("1" | "2")? | "3"')),
    ('start: _item+ [";"]\n_item: "a\\n" | "\\"q\\"" | [ "b" ]?',
     'root ::= _item+ (";")?\n_item ::= "a\\n" | "\\"q\\"" | ("b")?'),
    ('start: "x" start\n     | ', 'root ::= "x" root | ""'),
]


@pytest.mark.parametrize("lark, gbnf", CONVERTED)
def test_conversion_text_and_xgrammar_accepts_it(lark, gbnf):
    assert looks_like_lark(lark)
    assert lark_to_gbnf(lark) == gbnf
    validate(StructuredOutputsParams(grammar=gbnf))  # the GBNF itself is valid for xgrammar
    validate(StructuredOutputsParams(grammar=lark))


@pytest.mark.parametrize("text", ['root ::= "a"', 'root ::= x\nx ::= "a:b"', "just words"])
def test_gbnf_and_other_text_is_not_lark(text):
    assert not looks_like_lark(text)


REFUSED = [
    ('start: "a"\n  | /b+/', (" line 2: regular-expression terminals (/.../) are not supported; "
     "write them as GBNF character classes")),
    ('start: WORD\n%import common.WORD', (" line 2: %import is not supported; write the "
     "imported rules out")),
    ('start: "a"\n%ignore " "', (" line 2: %ignore is not supported (GBNF skips nothing); write "
     "the whitespace into the rules")),
    ('%declare X\nstart: "a"', (" line 1: %declare is not supported (a declared terminal has no "
     "definition)")),
    ('start: "a".."z"', (' line 1: ranges ("a".."z") are not supported; write them as GBNF '
     "character classes ([a-z])")),
    ('start: "a" -> yes', " line 1: aliases (-> name) are not supported; leave them out"),
    ('start: "a" ~ 3', (" line 1: repetition counts (~ n) are not supported; write the "
     "repetitions out")),
    ('pair{x}: x\nstart: pair{"a"}', " line 1: templates (name{...}) are not supported"),
    ('start: "a"i', ' line 1: case-insensitive literals ("..."i) are not supported'),
    ('start: a\nroot: "b"\na: "c"', (" line 2: a rule named 'root' is not supported ('start' "
     "becomes GBNF's start rule 'root'); rename it")),
    ('value: "a"', ": no 'start' rule (the start rule, which becomes GBNF's 'root')"),
    ('start: x', " line 1: 'x' is not defined"),
    ('start: "a"\nstart: "b"', " line 2: 'start' is defined twice (first on line 1)"),
    ('start: ("a"\n  | "b"', " line 2: missing ')'"),
    ('start: "a")', " line 1: unexpected ')'"),
    ("start: 'a'", " line 1: unexpected character \"'\""),
    ('start: * "a"', " line 1: '*' follows nothing"),
    ('start: "a\n', " line 1: unterminated literal"),
    ('start: "a"\nfoo bar', (" line 2: expected a definition 'name: ...' or a continuation "
     "line starting with '|'")),
]


@pytest.mark.parametrize("lark, why", REFUSED)
def test_refusals_name_the_construct_and_line(lark, why):
    with pytest.raises(ValueError) as info:
        lark_to_gbnf(lark)
    assert str(info.value) == f"Lark grammar{why}"
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar=lark))
    assert str(info.value) == f"invalid grammar in structured_outputs: Lark grammar{why}{HINT}"


def test_xgrammar_error_in_converted_text_shows_that_text():
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar='start: "\\q"'))
    assert str(info.value) == (
        "invalid grammar in structured_outputs: line 1, column 11 (after 'root ::= \"'): "
        "Invalid escape sequence (in the GBNF converted from the Lark grammar: "
        "'root ::= \"\\\\q\"')")


def test_lark_choice_generation_is_one_of_the_alternatives(tiny_llama):
    llm = LLM(model=tiny_llama.path, num_kv_blocks=64, block_size=16)
    grammar = ('// a choice\n?start: answer\n!answer: "yes" | "no"\n'
               '       | "maybe" [" later"]')
    allowed = {"yes", "no", "maybe", "maybe later"}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(grammar=grammar))
              for i in range(6)]
    outs = llm.generate(["the quick brown fox"] * 6, params, use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.text in allowed, (o.finish_reason, o.text)


def test_an_ebnf_error_gets_no_lark_sentence():
    """A GBNF grammar's own error (no ``name:`` rule line) is not blamed on Lark."""
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(grammar='root ::= "yes" |'))
    assert "Lark" not in str(info.value)
    assert str(info.value).endswith("but got the end of the grammar")
