"""Lark itself as the oracle for kvflow's Lark -> GBNF conversion (``lark_grammar``).

For each grammar, a string is accepted by ``lark.Lark(grammar, parser="earley",
lexer="dynamic_complete")`` (the grammar read as a context-free grammar over regular terminals,
the language ``lark_grammar`` promises) exactly when xgrammar's matcher over the converted GBNF
accepts it and can terminate. Strings: hand-written positives and negatives, mutations of the
positives (a character inserted, deleted or replaced) and random strings over the grammar's
alphabet, drawn with a fixed seed. Also: the table of common.lark terminals against the
installed Lark's own file, and a generation on the tiny model that Lark parses.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import xgrammar as xgr

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from kvflow.structured.lark_common import COMMON_TERMINALS, REWRITTEN
from kvflow.structured.lark_grammar import lark_to_gbnf

lark = pytest.importorskip("lark")

ARITHMETIC = r"""
?start: sum
?sum: product | sum "+" product -> add | sum "-" product -> sub
?product: atom | product "*" atom -> mul | product "/" atom -> div
?atom: NUMBER -> number | "-" atom -> neg | "(" sum ")"
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
"""
JSON_LIKE = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER -> number
      | "true" -> true | "false" -> false | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
SQL = r"""
start: select ";"?
select: SELECT columns FROM NAME [WHERE cond ("and"i cond)*]
columns: "*" | NAME ("," NAME)*
cond: NAME OP value
value: NUMBER | STRING
SELECT.2: /select/i
FROM: /from/i
WHERE: "where"i
OP: "=" | "<" | ">" | "<=" | ">=" | "!="
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /\d+(\.\d+)?/
STRING: /'[^'\n]*'/
%ignore /[ \t\n]+/
%ignore SQL_COMMENT
%import common.SQL_COMMENT
"""
RANGES = r"""
start: id ("," id)* -> ids
!id: ("a".."z" | "_") ("a".."z" | "0".."9") ~ 0..3 "x"?
"""
# the shape of OpenAI's custom-tool grammar examples: literal keywords, SP, regex terminals
OPENAI_TOOL = r"""
start: "SELECT" SP select_list SP "FROM" SP "orders" SP "WHERE" SP filter ("," SP filter)* ";"
select_list: column ("," SP column)*
column: "order_id" | "amount"
filter: "total_amount" SP OP SP NUMBER | "order_date" SP OP SP DATE
OP: ">" | "<" | "=" | ">=" | "<="
SP: " "
NUMBER: /[0-9]+/
DATE: /'[0-9]{4}-[0-9]{2}-[0-9]{2}'/
"""
REGEX_FEATURES = r"""
start: (WORD | HEX | QUOTED | ANYCHAR | SPACED)+
WORD: /\w{2,3}/
HEX: /0x[\da-f]{1,4}/i
QUOTED: /"([^"\\]|\\.)*"/
ANYCHAR: /#./s
SPACED: /(?x) \[ \s* (a|bc)? \s* \]/
"""

GRAMMARS = {
    "arithmetic": (ARITHMETIC, "0123456789.eE+-*/() \t", [
        "1+2", " 1 + 2 * (3-4) ", "-1.5e3/2", "1\t*\t2", "((7))", ".5E-1", "10-  -2"], [
        "1 +", "1 2", "(1", "", "1.5e", "1 + 2 \n", "e3"]),
    "json": (JSON_LIKE, '{}[]",:\\ab0-e.\n', [
        '{"a": [1, 2.5, true, null]}', '"a\\"b"', "{ }", ' [ "x" , -3e2 ] ', '"\\\\"',
        '{"k":{"k":[]}}', "\n-0.5\n"], [
        '"a"b"', '["a"]"]', "[1,]", '"a\nb"', '"\\"', "{1:2}", "tru"]),
    "sql": (SQL, "selctfromwhrand *,;='<>0123.xy_ \n-", [
        "select * from t;", "SeLeCt a, b FROM t where x >= 3",
        "select a from t where s = 'hi' AND y != 2.5", "select *from t -- all\n;",
        "selectafrom t", "select x\nfrom y"],
        ["select * from t where", "select from t", "select * from 't'", "select * from t;;",
         "select * -- c\nfrom"]),
    "ranges": (RANGES, "abz_09x,A", ["a", "ab0,_x9", "zx", "a,b,c", "a123x"], [
        "A", "a,", "9a", "", "a1234"]),
    "openai tool": (OPENAI_TOOL, "SELCTFROMWHorde_idamunt ,;<>='0123-", [
        "SELECT order_id, amount FROM orders WHERE total_amount >= 500;",
        "SELECT amount FROM orders WHERE order_date < '2024-01-31', total_amount = 7;"], [
        "SELECT amount FROM orders WHERE total_amount >= 5e2;",
        "SELECT amount FROM orders WHERE order_date < '2024-1-31';",
        "SELECT amount  FROM orders WHERE total_amount = 1;"]),
    "regex features": (REGEX_FEATURES, 'ab_0xF9"\\#\n [] c\u00e9\u0661', [
        "ab", "\u00e9\u0661", "0xFf", '"a\\"b"', "#\n", "[ a ]", "[]", "[bc]ab", "ab0X1"], [
        "a", "a b", "[ a", '"\\"', "#", "[ab]", "[ a ] ", ""]),
}


def _mutations(text: str, alphabet: str, rng: random.Random) -> str:
    at = rng.randrange(len(text) + 1)
    char = rng.choice(alphabet)
    kind = rng.randrange(3) if text else 0
    if kind == 0:
        return text[:at] + char + text[at:]
    at = min(at, len(text) - 1)
    return text[:at] + (char if kind == 1 else "") + text[at + 1:]


def _draws(alphabet: str, positives: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.6:
            text = rng.choice(positives)
            for _ in range(rng.randint(1, 2)):
                text = _mutations(text, alphabet, rng)
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        out.append(text)
    return out


class _Xgrammar:
    """xgrammar's verdict on whole strings (no tokenizer: bytes fed as a string)."""

    def __init__(self, gbnf: str) -> None:
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
        self.matcher = xgr.GrammarMatcher(compiler.compile_grammar(gbnf),
                                          terminate_without_stop_token=True)

    def accepts(self, text: str) -> bool:
        self.matcher.reset()
        return self.matcher.accept_string(text) and self.matcher.is_terminated()


def _lark_accepts(parser, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.UnexpectedInput:
        return False
    return True


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_xgrammar_over_the_conversion_agrees_with_lark(name):
    grammar, alphabet, positives, negatives = GRAMMARS[name]
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    converted = _Xgrammar(lark_to_gbnf(grammar))
    for text in positives:
        assert _lark_accepts(parser, text), text  # the hand-written strings are right
        assert converted.accepts(text), text
    for text in negatives:
        assert not _lark_accepts(parser, text), text
        assert not converted.accepts(text), text
    draws = _draws(alphabet, positives, 300, seed=sum(map(ord, name)))
    verdicts = {text: _lark_accepts(parser, text) for text in draws}
    disagree = [t for t, v in verdicts.items() if converted.accepts(t) != v]
    assert not disagree, disagree[:5]
    assert 0 < sum(verdicts.values()) < len(verdicts)  # both verdicts drawn


@pytest.mark.parametrize("name", ["arithmetic", "json"])
def test_lalr_agrees_on_grammars_without_lexical_overlap(name):
    """Lark's LALR parser (contextual lexer) tokenizes greedily; on these grammars no token
    is a prefix-overlap trap, so it accepts the same strings."""
    grammar, alphabet, positives, _ = GRAMMARS[name]
    earley = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    lalr = lark.Lark(grammar, parser="lalr")
    for text in positives + _draws(alphabet, positives, 200, seed=7):
        assert _lark_accepts(lalr, text) == _lark_accepts(earley, text), text


def test_converted_grammars_are_lark_grammars_and_lark_refuses_what_we_call_invalid():
    """The conversion tests' grammars build in Lark; the refusals that say Lark refuses the
    grammar too (zero-width, empty, recursive or rule-referring terminals, misplaced
    aliases) are Lark errors."""
    from test_lark_grammar import CONVERTED, REFUSED
    for grammar, gbnf in CONVERTED:
        lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
        _Xgrammar(gbnf)  # compiles (xgrammar 0.2.9 crashed the process on b ::= b{2})
    marks = ("(Lark refuses", "(Lark terminals", "(Lark:", "alias")
    lark_invalid = [g for g, why in REFUSED if any(m in why for m in marks)]
    assert len(lark_invalid) == 10
    for grammar in lark_invalid:
        with pytest.raises((lark.exceptions.GrammarError, lark.exceptions.UnexpectedInput)):
            lark.Lark(grammar, parser="earley", lexer="dynamic_complete")


def _common_lark() -> dict[str, str]:
    text = (Path(lark.__file__).parent / "grammars" / "common.lark").read_text()
    found = re.findall(r"^(\w+)\s*:\s*(.+?)\s*$", text, re.MULTILINE)
    return dict(found)


def test_common_table_is_lark_common_lark():
    theirs = _common_lark()
    helpers = {"_STRING_INNER", "_STRING_ESC_INNER"}  # parts of ESCAPED_STRING only
    assert set(theirs) - helpers == set(COMMON_TERMINALS)
    for name, definition in COMMON_TERMINALS.items():
        if name not in REWRITTEN:
            assert definition == theirs[name], name


COMMON_STRINGS = ['"', '""', '"a"', '"\\"', '"\\""', '"\\\\"', '"a"b"', '"\\\\\\"', '"\n"',
                  "/**/", "/* a */", "/***/", "/*/", "/* */ */", "/* * / **/", "0", "-1.5e+3",
                  ".5", "1.", "1e", "+", "abc", "_a1", "1a", "\r\n\n", "\r", " \t", "# x",
                  "// x", "-- x", "ff", "Zz"]


@pytest.mark.parametrize("name", [n for n in COMMON_TERMINALS if not n.startswith("_")])
def test_each_imported_terminal_agrees_with_lark(name):
    """Each importable terminal alone, the two rewritten ones included (same language)."""
    grammar = f"start: {name}\n%import common.{name}"
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    converted = _Xgrammar(lark_to_gbnf(grammar))
    alphabet = '"\\a/*\n 0.e-+1_Zx#\r'
    for text in COMMON_STRINGS + _draws(alphabet, COMMON_STRINGS, 150, seed=len(name)):
        assert converted.accepts(text) == _lark_accepts(parser, text), (name, text)


def test_lark_grammar_generation_parses_with_lark(tiny_llama):
    """The tiny random model, constrained by a Lark grammar with regex terminals, a range,
    an import and %ignore: every finished output parses with Lark."""
    grammar = ('start: pair ("," pair)* ";"\npair: KEY "=" (NUMBER | WORD)\n'
               'KEY: /[a-z][a-z0-9_]{0,5}/\nWORD: /"[^"\\n]{0,6}"/\n'
               'NUMBER: ("0".."9"){1,2}\n%import common.WS_INLINE\n%ignore WS_INLINE')
    grammar = grammar.replace('("0".."9"){1,2}', '"0".."9" ("0".."9")?')
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    llm = LLM(model=tiny_llama.path, num_kv_blocks=64, block_size=16)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(grammar=grammar))
              for i in range(6)]
    outs = llm.generate(["the quick brown fox"] * 6, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished, [o.outputs[0].text for o in outs]
    for o in finished:
        assert _lark_accepts(parser, o.text), o.text


# regex -> EBNF alone, Python's re as the oracle: fullmatch <=> xgrammar accepts
REGEXES = [
    (r"\d+", ""), (r"\w\W\s\S", ""), (r"\D.", ""), (r".", "s"), (r"[^a-c\]\-^\\]+", ""),
    (r"[\]\-^\\[]*", ""), (r"k+", "i"), (r"[a-z]{2}", "i"), (r"(?i:ab)c", ""),
    (r"(?x) a \ b (?s:.)", ""), (r"\t\n\x41\u00e9[\u0660-\u0669]", ""),
    (r"(ab|c|)(d(e|f)?){1,3}", ""), (r"a{0,2}b{2,}c?", ""), (r"[^\d\s]", ""), (r"[\W_]", ""),
    (r"\"([^\"\\]|\\.)*\"", ""), (r"(?a)\w+", ""), (r"[^\x00-\x7f]", ""),
]
REGEX_ALPHABET = 'abcdefABK\u212a\u017f01_-^]\\[ \t\n\r"\u00e9\u0661\u00a0\u3000.\x00'


def _python_matches(pattern: str, flags: str, text: str) -> bool:
    bits = 0
    for letter in flags:
        bits |= getattr(re, letter.upper())
    return re.fullmatch(pattern, text, bits) is not None


@pytest.mark.parametrize("pattern, flags", REGEXES)
def test_regex_translation_agrees_with_python_re(pattern, flags):
    from kvflow.structured.lark_regex import regex_to_ebnf
    expression, least = regex_to_ebnf(pattern, flags)
    converted = _Xgrammar(f"root ::= {expression.text}")
    rng = random.Random(pattern)
    draws = ["".join(rng.choice(REGEX_ALPHABET) for _ in range(rng.randint(0, 6)))
             for _ in range(400)]
    positives = [t for t in draws if _python_matches(pattern, flags, t)]
    for text in draws:
        assert converted.accepts(text) == _python_matches(pattern, flags, text), text
    assert least == min((len(t) for t in positives), default=least) or not positives


@pytest.mark.parametrize("pattern, flags", REGEXES)
def test_strings_python_re_generates_are_accepted(pattern, flags):
    """Positives drawn by hypothesis from the regex itself (``from_regex``), which random
    strings rarely hit for the longer patterns."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvflow.structured.lark_regex import regex_to_ebnf
    converted = _Xgrammar(f"root ::= {regex_to_ebnf(pattern, flags)[0].text}")
    bits = sum(getattr(re, letter.upper()) for letter in flags)

    @settings(max_examples=60, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.from_regex(re.compile(pattern, bits), fullmatch=True))
    def check(text):
        assert converted.accepts(text), text

    check()
