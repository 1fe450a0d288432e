"""The terminals of Lark's ``common.lark``, for ``%import common.NAME``.

Each entry is the Lark definition from ``lark/grammars/common.lark`` (Lark 1.x, MIT licence),
written out here so that kvflow needs no Lark at run time; ``tests/test_lark_grammar.py``
checks the table against the installed Lark's file. Two definitions differ in text, not in the
strings Lark accepts (the same test checks that with Lark as the oracle): Lark writes
``ESCAPED_STRING`` and ``C_COMMENT`` with lazy quantifiers and a lookbehind, which Lark's lexer
resolves to the first closing quote not escaped / the first ``*/``; here they are the equivalent
regular expressions without them. ``_STRING_INNER`` and ``_STRING_ESC_INNER``, the helpers of
Lark's ``ESCAPED_STRING``, are not importable.
"""

from __future__ import annotations

# the definitions whose text differs from common.lark's (same language; see the docstring)
REWRITTEN = {"ESCAPED_STRING", "C_COMMENT"}

COMMON_TERMINALS: dict[str, str] = {
    "DIGIT": '"0".."9"',
    "HEXDIGIT": '"a".."f"|"A".."F"|DIGIT',
    "INT": "DIGIT+",
    "SIGNED_INT": '["+"|"-"] INT',
    "DECIMAL": 'INT "." INT? | "." INT',
    "_EXP": '("e"|"E") SIGNED_INT',
    "FLOAT": "INT _EXP | DECIMAL _EXP?",
    "SIGNED_FLOAT": '["+"|"-"] FLOAT',
    "NUMBER": "FLOAT | INT",
    "SIGNED_NUMBER": '["+"|"-"] NUMBER',
    # common.lark: "\"" _STRING_ESC_INNER "\"" with _STRING_ESC_INNER: /.*?/ /(?<!\\)(\\\\)*?/
    "ESCAPED_STRING": r'"\"" /([^"\\\n]|\\.)*/ "\""',
    "LCASE_LETTER": '"a".."z"',
    "UCASE_LETTER": '"A".."Z"',
    "LETTER": "UCASE_LETTER | LCASE_LETTER",
    "WORD": "LETTER+",
    "CNAME": '("_"|LETTER) ("_"|LETTER|DIGIT)*',
    "WS_INLINE": r'(" "|/\t/)+',
    "WS": r"/[ \t\f\r\n]/+",
    "CR": r"/\r/",
    "LF": r"/\n/",
    "NEWLINE": "(CR? LF)+",
    "SH_COMMENT": r"/#[^\n]*/",
    "CPP_COMMENT": r"/\/\/[^\n]*/",
    # common.lark: "/*" /(.|\n)*?/ "*/"
    "C_COMMENT": r'"/*" /([^*]|\*+[^*\/])*\*+\//',
    "SQL_COMMENT": r"/--[^\n]*/",
}
