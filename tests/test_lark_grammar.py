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
        "rules, literals, ranges, /regex/ terminals, groups, quantifiers, %import common and "
        "%ignore)")

CONVERTED = [
    ('start: "yes" | "no"', 'root ::= "yes" | "no"'),
    ('?start: value\nvalue: "a"', 'root ::= value\nvalue ::= "a"'),
    (('// pairs\n?start: pair ("," pair)*  // more\n!pair: KEY ":" [VALUE]+\n'
     'KEY.2: "k" | "kk"\n\nVALUE: ("1"\n     | "2")+\n     | "3"'),
     ('root ::= pair ("," pair)*\npair ::= KEY ":" (VALUE)*\nKEY ::= "k" | "kk"\n'
     'VALUE ::= ("1" | "2")+ | "3"')),
    ('start: _item+ [";"]\n_item: "a\\n" | "\\"q\\"" | [ "b" ]?',
     'root ::= _item+ (";")?\n_item ::= "a\\n" | "\\"q\\"" | ("b")?'),
    ('start: "x" start\n     | ', 'root ::= "x" root | ""'),
    # aliases dropped; regex terminals and ranges become classes; "..."i a class a letter
    ('start: NAME "=" /[0-9]+/ -> assign\n     | "on"i -> on\nNAME: /[a-z_](?i:[a-c])?/ | "A".."C"',
     'root ::= NAME "=" [0-9]+ | [Oo] [Nn]\nNAME ::= [_a-z] [A-Ca-c]? | [A-C]'),
    ('start: "a" ~ 3 ("b" | "c") ~ 0..2 A ~ 2 "d" ~ 0\nA: "e" ~ 1..2',
     'root ::= "a"{3} ("b" | "c"){0,2} A{2} ""\nA ::= "e"{1,2}'),
    (r'start: /(ab|c){2,3}x.\//s', r'root ::= ("ab" | "c"){2,3} "x" [\u0000-\ud7ff\ue000-\U0010ffff] "/"'),
    # a terminal is one expression: the terminals it refers to inline (and imported ones'
    # parts only so); %ignore's expression follows every token of a rule and starts root
    ('start: INT ("," X)*\n%import common.INT\n%import common.DIGIT -> X\n%ignore " "',
     'root ::= " "* start\nstart ::= INT " "* ("," " "* X " "*)*\nINT ::= [0-9]+\nX ::= [0-9]'),
    ('start: a\na: WORD+\n%import common (WORD, WS)\n%ignore WS\n%ignore /#[^\\n]*/',
     ('root ::= (@ | "#" [^\\u000a]*)* start\nstart ::= a\na ::= (WORD (@ | "#" [^\\u000a]*)*)+\n'
      'WORD ::= ([A-Z] | [a-z])+\nWS ::= @+').replace("@", "[\\u0009-\\u000a\\u000c-\\u000d ]")),
    # a rule under ~ is written out (xgrammar 0.2.9 crashed compiling b ::= b{2})
    ('start: "x" | b\nb: b ~ 2 | ("y" b) ~ 1..3 | c ~ 0..1\nc: "z"',
     'root ::= "x" | b\nb ::= b b | ("y" b) (("y" b) (("y" b))?)? | (c)?\nc ::= "z"'),
    ('start: B C\nA: "a" | "b"\nB: A+ "c"\nC: B ~ 2',
     'root ::= B C\nA ::= "a" | "b"\nB ::= ("a" | "b")+ "c"\nC ::= (("a" | "b")+ "c"){2}'),
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
    ('start: "a"\n  | /b+?/', (" line 2: in /b+?/: lazy quantifiers (*? +? ?? {m,n}?: Lark's "
     "lexer takes the shortest match, which GBNF cannot express; write the terminal without "
     'one, e.g. /"[^"]*"/ for /".*?"/)')),
    ("start: /a(?=b)/", (" line 1: in /a(?=b)/: lookahead / lookbehind assertions are not "
     "supported in regular expressions")),
    ("start: /^a/", (" line 1: in /^a/: anchors and word boundaries (^ $ \\A \\Z \\b \\B) are "
     "not supported in regular expressions")),
    (r"start: /(a)\1/", (r" line 1: in /(a)\1/: backreferences are not supported in regular "
     "expressions")),
    ("start: /a/l", " line 1: in /a/l: regex flag 'l' is not supported (Lark's flags: imsux)"),
    ("start: /a(/", (" line 1: in /a(/: invalid regular expression /a(/: missing ), "
     "unterminated subpattern at position 1")),
    ("start: /a*/", " line 1: /a*/ matches the empty string (Lark refuses zero-width terminals)"),
    ('start: A\nA: "a"?', (" line 1: terminal 'A' matches the empty string (Lark refuses "
     "zero-width terminals)")),
    ('start: A\nA: "a" A | "a"', (" line 2: terminal 'A' refers to itself (Lark terminals "
     "cannot be recursive)")),
    ('start: A\nA: b\nb: "x"', (" line 2: a terminal refers to the rule 'b' (Lark terminals "
     "refer to terminals only)")),
    ('start: "ab".."z"', (' line 1: a range needs two single characters, the first not after '
     'the second ("ab".."z")')),
    ('start: "a" ->', " line 1: '->' without a name"),
    ('start: "a" -> x "b"', " line 1: an alias (-> name) must end its alternative"),
    ('start: "a" -> X', " line 1: an alias names a rule, in lower case (not 'X')"),
    ('start: ("a" -> x)', (" line 1: an alias (-> name) belongs at the end of a rule's "
     "alternative, not in a group, a terminal or %ignore")),
    ('start: A\nA: "a" -> x', (" line 2: an alias (-> name) belongs at the end of a rule's "
     "alternative, not in a group, a terminal or %ignore")),
    ('start: "a"\nB:', (" line 2: terminal 'B' has an empty definition (Lark: terminals "
     "cannot be empty)")),
    ('start: WORD\n%import common.FOO', (" line 2: common.FOO is not supported; kvflow imports "
     "these terminals of common.lark: DIGIT, HEXDIGIT, INT, SIGNED_INT, DECIMAL, FLOAT, "
     "SIGNED_FLOAT, NUMBER, SIGNED_NUMBER, ESCAPED_STRING, LCASE_LETTER, UCASE_LETTER, LETTER, "
     "WORD, CNAME, WS_INLINE, WS, CR, LF, NEWLINE, SH_COMMENT, CPP_COMMENT, C_COMMENT, "
     "SQL_COMMENT")),
    ('start: X\n%import .other.X', (" line 2: '%import .other.X' is not supported; kvflow "
     "imports the terminals of Lark's common.lark only (%import common.NAME, %import "
     "common.NAME -> ALIAS, %import common (A, B))")),
    ('start: num\n%import common.INT -> num', (" line 2: common.INT is a terminal; import it "
     "under an upper-case name, not 'num'")),
    ('start: INT\nINT: "1"\n%import common.INT', (" line 3: 'INT' is defined twice (first on "
     "line 2)")),
    ('start: "a"\n%ignore /b*/', (" line 2: %ignore /b*/ matches the empty string (Lark refuses "
     "zero-width terminals)")),
    ('%declare X\nstart: "a"', (" line 1: %declare is not supported (a declared terminal has no "
     "definition)")),
    ('  | "a"\nstart: "b"', (" line 1: a '|' line continues no definition (it follows a "
     "directive or starts the grammar)")),
    ('start: "a"\n%ignore " "\n  | "b"', (" line 3: a '|' line continues no definition (it "
     "follows a directive or starts the grammar)")),
    ('start: "a"\n%override x: "b"', (" line 2: directives other than %import and %ignore "
     "(%declare, %override ...) are not supported")),
    ('start: "a" ~ 3..2', (" line 1: the repetition ~ 3..2 needs its first count not above "
     "its second")),
    ('start: "a" ~ x', " line 1: '~' needs a count (~ n or ~ m..n)"),
    ('start: b ~ 101\nb: "x"', (" line 1: a repetition of a rule up to 101 times is not "
     "supported (at most 100)")),
    ('pair{x}: x\nstart: pair{"a"}', " line 1: templates (name{...}) are not supported"),
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


def test_served_lark_grammar_refusal_is_a_400_naming_the_construct(tiny_tokenizer):
    """Over HTTP (the chat handler's SamplingParams step, in-process): a Lark grammar with a
    lookahead in a regex terminal is a 400 at ``guided_grammar`` naming it and its line; the
    same grammar without it passes."""
    from types import SimpleNamespace

    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.sampling_requests import sampling_params
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(processor=InputProcessor(tiny_tokenizer, 64, 320, 0))
    grammar = 'start: NAME+\nNAME: /[a-z]+(?=;)/ ";"\n%ignore " "'

    def request(text):
        return ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "hi"}], "guided_grammar": text})

    with pytest.raises(OpenAIError) as e:
        sampling_params(engine, request(grammar), 4, None)
    assert e.value.status == 400
    assert e.value.body()["error"] == {
        "message": "invalid grammar in guided_grammar: Lark grammar line 2: in /[a-z]+(?=;)/: "
                   "lookahead / lookbehind assertions are not supported in regular "
                   f"expressions{HINT}",
        "type": "invalid_request_error", "param": "guided_grammar", "code": "invalid_value"}
    params = sampling_params(engine, request(grammar.replace("(?=;)", "")), 4, None)
    assert params.structured_outputs.grammar == grammar.replace("(?=;)", "")
