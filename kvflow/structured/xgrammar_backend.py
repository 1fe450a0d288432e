"""The xgrammar implementation of the grammar backend (https://github.com/mlc-ai/xgrammar).

xgrammar compiles JSON schemas, regexes and EBNF into a pushdown automaton with per-state token
masks precomputed for the tokenizer (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"), so filling one request's bitmask is
microseconds for most states.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from kvflow.structured.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvflow.structured.grammar_cycles import unit_cycle_problem
from kvflow.structured.json_pattern import placeholder_patterns, strict_formats
from kvflow.structured.lark_grammar import lark_to_gbnf, looks_like_lark
from kvflow.structured.params import StructuredOutputsParams
from kvflow.structured.regex_dialect import xgrammar_regex
from kvflow.structured.schema_support import costly_pattern, string_patterns, unenforced_keyword
from kvflow.structured.structural_tag import (
    StructuralTagError,
    check_format,
    check_legacy,
    format_schemas,
    grammar_formats,
    is_legacy,
    parse,
    regex_formats,
)
from kvflow.structured.text_tokens import special_token_ids, text_tokenizer_info
from kvflow.structured.utf8_grammar import printed_ebnf, utf8_grammar

# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_LOCATION_RE = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(error: Exception) -> str:
    lines = [_LOCATION_RE.sub("", line) for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line).strip()


# xgrammar's EBNF errors: "EBNF parser error at line 2, column 1: Expect element, but got x";
# at the end of the grammar the "got" part is empty and the column counts UTF-8 bytes.
_EBNF_ERROR = re.compile(r"EBNF (?:lexer|parser) error at line (\d+), column (\d+): (.*)",
                         re.DOTALL)
_ELEMENT = ('an element (a "quoted string", a [character class], a rule name or a '
            '(parenthesized group))')


def grammar_error(spec: str, message: str) -> str:
    """An EBNF error (``message``, xgrammar's, location prefix removed) in the grammar's
    terms: where (line, column in characters, and the grammar text just before it), what
    was expected and what the grammar has there (its next word, or ``the end of the
    grammar``: xgrammar's own message then ends in an empty "but got"). A message of
    another shape is returned unchanged."""
    found = _EBNF_ERROR.search(message)
    if found is None:
        return message + _lark_hint(spec)
    line, byte_column, what = int(found[1]), int(found[2]), found[3].strip()
    lines = spec.split("\n")
    text = lines[line - 1].encode() if line <= len(lines) else b""
    head = text[:byte_column - 1].decode(errors="ignore")
    before = "\n".join([*lines[:line - 1], head])
    after = "\n".join([text[byte_column - 1:].decode(errors="ignore"), *lines[line:]])
    if what.startswith("Expect "):  # "Expect )", "Expect element, but got x"
        expected, _, got = what.removeprefix("Expect ").partition(", but got")
        expected = _ELEMENT if expected.strip() == "element" else repr(expected.strip())
        got = got.strip() or (after.split()[0] if after.strip() else "")
        got = repr(got) if got else "the end of the grammar"
        what = f"expected {expected}, but got {got}"
    shown = before.strip()[-40:]
    where = f"line {line}, column {len(head) + 1}" + (f" (after {shown!r})" if shown else "")
    return f"{where}: {what}" + _lark_hint(spec)


def _lark_hint(spec: str) -> str:
    """For a grammar written in Lark's syntax that kvflow could not convert
    (``lark_grammar``): a sentence saying which syntax kvflow reads; else empty."""
    if not looks_like_lark(spec):
        return ""
    return (" (this looks like a Lark grammar, rules written 'name: ...'; kvflow reads "
            "GBNF / EBNF, rules written 'name ::= ...' with 'root' the start rule, and "
            "converts Lark's rules, literals, ranges, /regex/ terminals, groups, "
            "quantifiers, %import common and %ignore)")


def _grammar_text(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec) with choices turned into an EBNF alternation of JSON-quoted literals
    (EBNF string literals use JSON escapes, so any Unicode text is safe), a grammar in
    Lark's syntax converted to GBNF (``lark_grammar.lark_to_gbnf``; its ValueError passes)
    and a regex written in xgrammar's dialect (``regex_dialect.xgrammar_regex``: ``.`` does
    not match a newline; its ValueError passes)."""
    if params.kind == "regex":
        return "regex", xgrammar_regex(params.regex)
    if params.kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return "grammar", f"root ::= {alternatives}"
    if params.kind == "grammar" and looks_like_lark(params.grammar):
        return "grammar", lark_to_gbnf(params.grammar)
    return params.key


def _schema_text(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, (dict, bool)):
        return spec
    raise ValueError("a JSON schema must be an object (or true/false)")


# xgrammar (0.2.9) writes a string with minLength / maxLength as repetitions of this character
# class, which lets the raw control characters U+0000-U+001F (but CR and LF) through: a tab or
# \x0b inside a JSON string, which JSON parsers refuse. Its other strings use the second class.
# Both classes also match the UTF-16 surrogates U+D800-U+DFFF, whose UTF-8 spellings (ED A0-BF
# xx) are not UTF-8: the text decodes to three U+FFFD per surrogate (so a maxLength string came
# out longer than its bound). Both are rewritten to ``_JSON_STRING_CHARS``.
# (as ``utf8_grammar.printed_ebnf`` writes them: \x1f is \u001f)
_LENGTH_STRING_CHARS = r'[^\"\\\r\n]'
_XGRAMMAR_STRING_CHARS = r'[^\0-\u001f\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\u001f\"\\\r\n\uD800-\uDFFF]'


def json_only_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (xgrammar's conversion of a JSON schema) with its string characters kept to
    what a JSON string may hold as UTF-8 text: no raw control characters, no surrogates."""
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
            one whose string patterns repeat more than xgrammar converts in well under a
            second (``schema_support.costly_pattern``), or one with a string pattern that is
            not a valid regex (:func:`bad_pattern`, naming it and where it is).
        RuntimeError: from xgrammar, for a schema it cannot convert.
    """
    text = _schema_text(spec)
    schema = json.loads(text)
    problem = unenforced_keyword(schema)
    if problem is not None:
        raise ValueError(f"{problem} (xgrammar, kvflow's grammar engine, accepts this keyword "
                         "but does not enforce it; leave it out)")
    problem = costly_pattern(schema) or bad_pattern(schema)  # costly: before xgrammar spends
    if problem is not None:  # minutes on it; bad: xgrammar converts placeholders (below)
        raise ValueError(problem)
    # patterns converted by utf8_grammar in place of placeholders (json_pattern: xgrammar's
    # own conversion wrote their quotes raw and let overlong UTF-8 through)
    converted, patterns = placeholder_patterns(strict_formats(schema))
    grammar = xgr.Grammar.from_json_schema(json.dumps(converted), any_whitespace=False)
    fixed = utf8_grammar(json_only_strings(grammar), patterns)
    if any(name in str(fixed) for name in patterns):  # a placeholder converted as text
        fixed = utf8_grammar(json_only_strings(xgr.Grammar.from_json_schema(
            text, any_whitespace=False)))
    return fixed


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
            problem = _schema_problem(node["json_schema"])
            if problem is not None:
                raise StructuralTagError(path, problem)
        regexes = regex_formats(tag)
        for path, node in regexes:
            try:
                node["pattern"] = xgrammar_regex(node["pattern"])
            except ValueError as e:
                raise StructuralTagError(f"{path}.pattern", str(e)) from None
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
                raise StructuralTagError(f"structures.{i}.schema", _clean(e)) from None
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "grammar", "grammar": grammars[text]}})
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}},
        ensure_ascii=False)


def _schema_problem(schema: Any) -> str | None:
    """Why kvflow refuses a schema inside a ``format`` structural tag (a keyword xgrammar
    would not enforce, a costly pattern), or None."""
    problem = unenforced_keyword(schema)
    if problem is not None:
        return (f"{problem} (xgrammar, kvflow's grammar engine, accepts this keyword but does "
                "not enforce it; leave it out)")
    return costly_pattern(schema)


# xgrammar resolves token names / ids of a ``format`` tag (``token``, ``any_tokens``, ...)
# only with the tokenizer: ``validate`` has none, the compile checks them.
_NEEDS_TOKENIZER = "requires tokenizer_info"


def _check_structural_tag(spec: str) -> None:
    """Raises StructuralTagError / ValueError / xgrammar's RuntimeError for a structural tag
    that does not convert, or whose grammar holds a rule defined only as itself
    (``grammar_cycles``: a ``grammar`` format's rule would crash xgrammar's compiler). A tag
    that names tokens converts only with the tokenizer: then each ``grammar`` format in it
    is checked alone."""
    text = structural_tag_text(spec)
    try:
        grammars = [xgr.Grammar.from_structural_tag(text)]
    except RuntimeError as e:
        if _NEEDS_TOKENIZER not in str(e):
            raise
        grammars = [xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": node})
                    for node in grammar_formats(json.loads(text))]
    for grammar in grammars:
        problem = unit_cycle_problem(str(grammar))
        if problem is not None:
            raise ValueError(problem)


def bad_pattern(schema: Any) -> str | None:
    """Why the first string pattern of ``schema`` (a parsed JSON schema) that xgrammar's
    regex parser refuses is refused, naming the pattern and where it is
    (``the pattern 'a[' at properties.code.pattern is not a valid regex: ...``); None when
    every pattern parses."""
    for path, pattern in string_patterns(schema):
        try:
            xgr.Grammar.from_regex(pattern)
        except RuntimeError as e:
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            return f"the pattern {shown!r} at {path} is not a valid regex: {_clean(e)}"
    return None


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint without a tokenizer (cheap; for the API process / add time).

    Raises:
        ValueError: naming the problem in a malformed JSON schema, regex or EBNF grammar,
            or structural tag (naming the field inside it: ``structures.0.begin``), or in
            a Lark grammar outside the subset ``lark_grammar`` converts.
    """
    try:
        kind, spec = _grammar_text(params)
    except ValueError as e:  # a Lark grammar outside the subset kvflow converts, an anchor
        if params.kind == "regex":
            raise ValueError(f"invalid regex in structured_outputs: {e}") from None
        raise ValueError(f"invalid grammar in structured_outputs: {e}"
                         f"{_lark_hint(params.grammar)}") from None
    try:
        if kind == "json":
            json_schema_grammar(spec)
        elif kind == "regex":
            try:
                xgr.Grammar.from_regex(spec)
            except RuntimeError:  # the pattern as sent: its error's positions are the user's
                xgr.Grammar.from_regex(params.regex)
                raise
        elif kind == "structural_tag":
            _check_structural_tag(spec)
        elif kind == "grammar":
            problem = unit_cycle_problem(str(xgr.Grammar.from_ebnf(spec)))
            if problem is not None:  # xgrammar's compiler would crash the process
                raise ValueError(problem)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                "structural_tag": "structural tag"}[kind]
        why = grammar_error(spec, _clean(e)) if params.kind == "grammar" else _clean(e)
        if params.kind == "grammar" and spec != params.grammar:
            why += f" (in the GBNF converted from the Lark grammar: {_shown(spec)})"
        if params.kind == "choice":
            what = "choice"
        raise ValueError(f"invalid {what} in structured_outputs: {why}") from None


def _shown(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


class XgrammarGrammar(StructuredOutputGrammar):
    """A ``xgr.GrammarMatcher`` behind the backend interface."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self._num_accepted = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                return False
            self._num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self._num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # stop token taken (the scheduler ends such a
            bitmask[row].zero_()  # request with ``stop``): nothing more is allowed
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted


class XgrammarBackend(StructuredOutputBackend):
    """Compiles for one HF tokenizer.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's size; the extra ids
            are never allowed).
        eos_token_id: the engine's EOS id: the only token that may end a complete grammar.
        max_threads: compiler threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop)
        # text grammars: special tokens spell no text (``text_tokens``); structural tags
        # keep xgrammar's reading (their token formats name special tokens). No xgrammar
        # cache: it keys a grammar by its printing and compiles that text, which xgrammar
        # (0.2.9) misreads (``utf8_grammar.printed_ebnf``: the enum "Ünïcödé" became "Ün"
        # U+0EFC U+0F6D "é"); the manager caches compiled grammars by constraint.
        text_info = text_tokenizer_info(info, special_token_ids(tokenizer))
        self._compiler = xgr.GrammarCompiler(text_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._tag_compiler = xgr.GrammarCompiler(info, max_threads=max_threads,
                                                 cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """``params``' constraint compiled for the model's vocabulary.

        Raises:
            ValueError: for a constraint ``validate`` refuses, or a structural tag xgrammar
                cannot compile (a token name or id the vocabulary lacks).
        """
        validate(params)
        kind, spec = _grammar_text(params)
        if kind == "json":
            # Compact separators (", " and ": "): tiny or weak models otherwise wander off in
            # whitespace until max_tokens.
            return self._compiler.compile_grammar(json_schema_grammar(spec))
        if kind == "json_object":
            # Any object: additional properties allowed (strict mode would forbid them all).
            return self._compiler.compile_grammar(utf8_grammar(json_only_strings(
                xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False))))
        if kind == "regex":
            return self._compiler.compile_grammar(utf8_grammar(xgr.Grammar.from_regex(spec)))
        if kind == "structural_tag":  # what validate could not check: token names and ids
            try:
                return self._compile_structural_tag(structural_tag_text(spec))
            except RuntimeError as e:
                raise ValueError(f"invalid structural tag in structured_outputs: {_clean(e)}"
                                 ) from None
        return self._compiler.compile_grammar(utf8_grammar(xgr.Grammar.from_ebnf(spec)))

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """A structural tag (xgrammar's ``format`` JSON text) compiled as UTF-8 text
        (``utf8_grammar``), over xgrammar's own reading of the vocabulary (special tokens
        spell their text: a trigger may be one). A tag that names tokens converts only with
        the tokenizer: it is compiled as written (its grammars may hold surrogates).

        Raises:
            RuntimeError: from xgrammar, for a tag it cannot compile.
        """
        try:
            grammar = xgr.Grammar.from_structural_tag(text)
        except RuntimeError as e:
            if _NEEDS_TOKENIZER not in str(e):
                raise
            return self._tag_compiler.compile_structural_tag(text)
        return self._tag_compiler.compile_grammar(utf8_grammar(grammar))

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
