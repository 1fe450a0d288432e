"""A constraint converted to xgrammar's terms: its grammar text (choices as an EBNF
alternation, Lark grammars as GBNF, regexes in xgrammar's dialect), a JSON schema's grammar
kept to JSON's and UTF-8's characters, and a structural tag as xgrammar's ``format`` JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from kvflow.structured.json_pattern import (
    json_pattern_empty,
    placeholder_patterns,
    strict_formats,
)
from kvflow.structured.lark_grammar import lark_to_gbnf, looks_like_lark
from kvflow.structured.params import StructuredOutputsParams
from kvflow.structured.regex_classes import negated_regex
from kvflow.structured.regex_dialect import xgrammar_regex
from kvflow.structured.regex_empty import EMPTY_REGEX, regex_matches_nothing
from kvflow.structured.schema_patterns import costly_pattern, map_schemas, string_patterns
from kvflow.structured.schema_support import unenforced_keyword
from kvflow.structured.structural_tag import (
    StructuralTagError,
    check_format,
    check_legacy,
    format_schemas,
    is_legacy,
    parse,
    regex_formats,
)
from kvflow.structured.utf8_grammar import printed_ebnf, utf8_grammar
from kvflow.structured.xgrammar_errors import clean_error

# xgrammar resolves token names / ids of a ``format`` tag (``token``, ``any_tokens``, ...)
# only with the tokenizer: ``validate`` has none, the compile checks them.
NEEDS_TOKENIZER = "requires tokenizer_info"


def regex_text(pattern: str) -> str:
    """A ``regex`` constraint (or a structural tag's ``regex`` format) as kvflow hands it to
    xgrammar: in xgrammar's dialect (``regex_dialect.xgrammar_regex``), each character class
    written negated (``regex_classes.negated_regex``), the form xgrammar repeats cheaply
    (``[a-z]{1,300}\\d``: 0.8-1.6 s -> 0.06-0.1 s to compile, ``docs/benchmarks.md``).

    Raises:
        ValueError: from ``xgrammar_regex``, for a letter escape xgrammar reads as the letter.
    """
    return negated_regex(xgrammar_regex(pattern))


def grammar_text(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec) with choices turned into an EBNF alternation of JSON-quoted literals
    (EBNF string literals use JSON escapes, so any Unicode text is safe), a grammar in
    Lark's syntax converted to GBNF (``lark_grammar.lark_to_gbnf``; its ValueError passes)
    and a regex written in xgrammar's dialect (``regex_dialect.xgrammar_regex``: ``.`` does
    not match a newline; its ValueError passes) with its classes written negated, as a
    JSON-schema pattern's are (:func:`regex_text`)."""
    if params.kind == "regex":
        return "regex", regex_text(params.regex)
    if params.kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return "grammar", f"root ::= {alternatives}"
    if params.kind == "grammar" and looks_like_lark(params.grammar):
        return "grammar", lark_to_gbnf(params.grammar)
    return params.key


def _schema_text(spec: str) -> str:
    """``spec`` itself, checked to be a JSON schema: a JSON object or true/false."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, (dict, bool)):
        return spec
    raise ValueError("a JSON schema must be an object (or true/false)")


# xgrammar (0.2.9) writes a string with minLength / maxLength (and a ``propertyNames`` length)
# as repetitions of one character of this class, which lets the raw control characters
# U+0000-U+001F (but CR and LF) through: a tab or \x01 inside a JSON string, which JSON (RFC
# 8259 s.7) forbids. Its other strings use the second class. Both classes also match the UTF-16
# surrogates U+D800-U+DFFF, whose UTF-8 spellings (ED A0-BF xx) are not UTF-8: the text decodes
# to three U+FFFD per surrogate (so a maxLength string came out longer than its bound). Both
# are rewritten to ``_JSON_STRING_CHARS``. A length-limited string takes no escape (``\n``,
# ``\u0001``), as in xgrammar: one character class repeated is xgrammar's fast case, and a
# class-or-escape rule repeated filled a mask in 40 ms (maxLength 30) to 1 s (maxLength 200)
# instead of 0.05 ms (49k vocabulary; docs/structured-output.md).
# (as ``utf8_grammar.printed_ebnf`` writes them: \x1f is \u001f)
_LENGTH_STRING_CHARS = r'[^\"\\\r\n]'
_XGRAMMAR_STRING_CHARS = r'[^\0-\u001f\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\u001f\"\\\r\n\uD800-\uDFFF]'


def json_only_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (xgrammar's conversion of a JSON schema, or of a structural tag's JSON
    schemas) with its string characters kept to what a JSON string may hold as UTF-8 text:
    no raw control characters, no surrogates."""
    ebnf = printed_ebnf(grammar)
    if _LENGTH_STRING_CHARS not in ebnf and _XGRAMMAR_STRING_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_STRING_CHARS, _JSON_STRING_CHARS)
                                 .replace(_XGRAMMAR_STRING_CHARS, _JSON_STRING_CHARS))


def json_schema_grammar(spec: str) -> xgr.Grammar:
    """The grammar of a JSON schema (compact separators), with length-limited strings kept
    to JSON's characters (``_LENGTH_STRING_CHARS``) and every string, ``pattern`` included,
    to UTF-8 text (``utf8_grammar``).

    Raises:
        ValueError: for text that is not a JSON schema object (or true/false), one using a
            keyword xgrammar would not enforce (``schema_support.unenforced_keyword``), or
            one whose string patterns repeat more than kvflow or xgrammar converts in well under a
            second (``schema_patterns.costly_pattern``), or one with a string pattern that is
            not a valid regex (:func:`bad_pattern`, naming it and where it is).
        RuntimeError: from xgrammar, for a schema it cannot convert.
    """
    text = _schema_text(spec)
    schema = json.loads(text)
    problem = unenforced_keyword(schema)
    if problem is not None:
        raise ValueError(unenforced_refusal(problem))
    problem = costly_pattern(schema) or bad_pattern(schema)  # costly: before xgrammar spends
    if problem is not None:  # minutes on it; bad: xgrammar converts placeholders (below)
        raise ValueError(problem)
    # patterns converted by utf8_grammar in place of placeholders (json_pattern: xgrammar's
    # own conversion wrote their quotes raw and let overlong UTF-8 through)
    converted, patterns = placeholder_patterns(strict_formats(open_arrays(schema)))
    grammar = xgr.Grammar.from_json_schema(json.dumps(converted), any_whitespace=False)
    fixed = utf8_grammar(json_only_strings(grammar), patterns)
    if any(name in str(fixed) for name in patterns):  # a placeholder converted as text:
        problem = costly_pattern(schema, kvflow_converts=False)  # xgrammar converts them all
        if problem is not None:
            raise ValueError(problem)
        fixed = utf8_grammar(json_only_strings(xgr.Grammar.from_json_schema(
            json.dumps(open_arrays(schema)), any_whitespace=False)))
    return fixed


# an array schema with one of these says what its items are (prefixItems alone: a closed
# tuple, as xgrammar's strict mode reads it, like an object's listed properties)
_ITEMS = ("items", "prefixItems", "additionalItems", "unevaluatedItems")


def open_arrays(schema: Any) -> Any:
    """A copy of ``schema`` (a parsed JSON schema) whose arrays that say nothing of their
    items (none of ``_ITEMS``) say ``"items": true``, as JSON Schema reads them and as
    xgrammar (0.2.9) reads ``{"type": "array"}`` alone; beside ``minItems`` / ``maxItems``
    it read them as arrays of no items: ``{"type": "array", "maxItems": 3}`` took only
    ``[]``, and ``"minItems": 1`` was refused ("additional items are not allowed")."""
    def one(sub: dict[str, Any]) -> dict[str, Any]:
        types = sub.get("type") if isinstance(sub.get("type"), list) else [sub.get("type")]
        array = "array" in types if "type" in sub else \
            any(key in sub for key in ("minItems", "maxItems"))
        if array and not any(key in sub for key in _ITEMS):
            return {**sub, "items": True}
        return sub
    return map_schemas(schema, one)


def structural_tag_text(spec: str) -> str:
    """The structural tag in ``spec`` (JSON text) as xgrammar's ``format`` spelling (JSON
    text for ``GrammarCompiler.compile_structural_tag``). A legacy tag becomes one
    ``triggered_tags`` format whose tags hold the grammar of their schemas as
    :func:`json_schema_grammar` writes it (so a structure's JSON is written as
    ``response_format`` json_schema's is: compact separators, checked keywords, JSON-only
    characters in length-limited strings). A ``format`` tag is passed as written (xgrammar's
    own JSON conversion for its schemas, whitespace as xgrammar allows it), its schemas
    checked for keywords xgrammar would not enforce and costly patterns, the patterns of its
    ``regex`` formats written as a ``regex`` constraint's are (``regex_dialect``).

    Raises:
        StructuralTagError: naming the field inside the tag (``structures.0.schema``) and
            why, for a malformed tag or schema; a schema xgrammar cannot convert included.
    """
    tag = parse(spec)
    if not is_legacy(tag):
        check_format(tag)
        for path, node in format_schemas(tag):
            problem = _schema_problem(node["json_schema"], node.get("style", "json") == "json")
            if problem is not None:
                raise StructuralTagError(path, problem)
        regexes = regex_formats(tag)
        for path, node in regexes:
            try:
                node["pattern"] = regex_text(node["pattern"])
            except ValueError as e:
                raise StructuralTagError(f"{path}.pattern", str(e)) from None
            if regex_matches_nothing(node["pattern"]):
                raise StructuralTagError(f"{path}.pattern", f"matches no string: {EMPTY_REGEX}")
        return json.dumps(tag, ensure_ascii=False) if regexes else spec
    check_legacy(tag)
    grammars: dict[str, str] = {}  # schema text -> grammar: a schema shared by tags converts once
    tags = []
    for i, structure in enumerate(tag["structures"]):
        text = json.dumps(structure["schema"], ensure_ascii=False)
        if text not in grammars:
            try:
                grammars[text] = printed_ebnf(json_schema_grammar(text))
            except (RuntimeError, ValueError) as e:
                raise StructuralTagError(f"structures.{i}.schema", clean_error(e)) from None
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "grammar", "grammar": grammars[text]}})
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}},
        ensure_ascii=False)


def structural_tag_grammar(text: str) -> xgr.Grammar:
    """The grammar of a structural tag in xgrammar's ``format`` spelling (``text``, from
    :func:`structural_tag_text`) as UTF-8 text (``utf8_grammar``), the ``pattern`` strings of
    its JSON-style ``json_schema`` formats converted by kvflow as a ``json`` constraint's are
    (``json_pattern``: xgrammar wrote a literal quote of ``^a"b$`` raw inside the string, and
    gave a count past 32 its own JSON-string regex, which let overlong UTF-8 through), and
    ``ipv4`` written as JSON Schema's (``json_pattern.strict_formats``), and its JSON
    strings' characters as :func:`json_only_strings` writes them (a ``minLength`` string
    took a raw \x01). XML styles write their strings raw, so their patterns and the
    characters of their top-level strings are left to xgrammar.

    Raises:
        RuntimeError: from xgrammar, for a tag it cannot convert (``NEEDS_TOKENIZER`` in the
            message for one that names tokens).
        ValueError: for a pattern that does not convert (``utf8_grammar``).
    """
    tag = json.loads(text)
    patterns: dict[str, str] = {}
    for _, node in format_schemas(tag):
        if node.get("type") == "json_schema":
            node["json_schema"] = open_arrays(node["json_schema"])
        if node.get("type") == "json_schema" and node.get("style", "json") == "json":
            node["json_schema"], found = placeholder_patterns(
                strict_formats(node["json_schema"]), first=len(patterns))
            patterns.update(found)
    grammar = utf8_grammar(json_only_strings(xgr.Grammar.from_structural_tag(json.dumps(tag))),
                           patterns)
    if any(name in str(grammar) for name in patterns):  # a placeholder converted as text
        return utf8_grammar(json_only_strings(xgr.Grammar.from_structural_tag(text)))
    return grammar


# a refusal reason that already says how to write the schema instead ('add "type": ...',
# '(write the length into the pattern ...)'): "leave it out" would contradict it
_GIVES_A_FIX = re.compile(r": add |\(write ")


def unenforced_refusal(problem: str) -> str:
    """The refusal of a keyword xgrammar accepts but would not enforce: ``problem`` (from
    :func:`unenforced_keyword`) and why, advising to leave the keyword out only where
    ``problem`` gives no other way to write the schema."""
    advice = "" if _GIVES_A_FIX.search(problem) else "; leave it out"
    return (f"{problem} (xgrammar, kvflow's grammar engine, accepts this keyword but does not "
            f"enforce it{advice})")


def _schema_problem(schema: Any, json_style: bool) -> str | None:
    """Why kvflow refuses a schema inside a ``format`` structural tag (a keyword xgrammar
    would not enforce, a costly pattern: xgrammar converts the tag's patterns when it is
    validated; in a JSON-style schema, whose patterns kvflow converts, a pattern that is
    not a valid regex or matches no string: :func:`bad_pattern`), or None."""
    problem = unenforced_keyword(schema)
    if problem is not None:
        return unenforced_refusal(problem)
    return costly_pattern(schema, kvflow_converts=False) or \
        (bad_pattern(schema) if json_style else None)


def bad_pattern(schema: Any) -> str | None:
    """Why the first string pattern of ``schema`` (a parsed JSON schema) that xgrammar's
    regex parser refuses is refused, naming the pattern and where it is
    (``the pattern 'a[' at properties.code.pattern is not a valid regex: ...``); None when
    every pattern parses. Also refused: a ``pattern`` or ``patternProperties`` name no JSON
    string matches (``json_pattern.json_pattern_empty``: ``a[^\\s\\S]``), which would let
    the reply start (a string, or an object's key) and then allow no token, ending it with
    ``length``; a name matching only control characters (``[\\x01]``) would have been a
    raw control character inside a key, which JSON does not allow."""
    for path, pattern in string_patterns(schema):
        shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
        try:
            xgr.Grammar.from_regex(pattern)
        except RuntimeError as e:
            return f"the pattern {shown!r} at {path} is not a valid regex: {clean_error(e)}"
        if json_pattern_empty(pattern):
            return (f"the pattern {shown!r} at {path} matches no string: a character class "
                    "that every match goes through holds no character kvflow matches there "
                    "(it is empty, as [^\\s\\S], or holds only control characters other "
                    "than \\b \\f \\n \\r \\t, which a class here does not match)")
    return None
