"""A constraint checked without a tokenizer (``validate``: cheap, for the API process and
add time): converted to xgrammar's grammar, refused with a message naming the problem."""

from __future__ import annotations

import json

import xgrammar as xgr

from kvflow.structured.grammar_cycles import unit_cycle_problem
from kvflow.structured.params import StructuredOutputsParams
from kvflow.structured.regex_empty import EMPTY_REGEX, regex_matches_nothing
from kvflow.structured.structural_tag import grammar_formats
from kvflow.structured.xgrammar_convert import (
    NEEDS_TOKENIZER,
    grammar_text,
    json_schema_grammar,
    structural_tag_text,
)
from kvflow.structured.xgrammar_errors import clean_error, grammar_error, lark_hint, quoted_head


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
        if NEEDS_TOKENIZER not in str(e):
            raise
        grammars = [xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": node})
                    for node in grammar_formats(json.loads(text))]
    for grammar in grammars:
        problem = unit_cycle_problem(str(grammar))
        if problem is not None:
            raise ValueError(problem)


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint without a tokenizer (cheap; for the API process / add time).

    Raises:
        ValueError: naming the problem in a malformed JSON schema, regex or EBNF grammar,
            a regex no text matches (``regex_empty``), or structural tag (naming the field inside it: ``structures.0.begin``), or in
            a Lark grammar outside the subset ``lark_grammar`` converts.
    """
    try:
        kind, spec = grammar_text(params)
    except ValueError as e:  # a Lark grammar outside the subset kvflow converts, an anchor
        if params.kind == "regex":
            raise ValueError(f"invalid regex in structured_outputs: {e}") from None
        raise ValueError(f"invalid grammar in structured_outputs: {e}"
                         f"{lark_hint(params.grammar)}") from None
    try:
        if kind == "json":
            json_schema_grammar(spec)
        elif kind == "regex":
            try:
                xgr.Grammar.from_regex(spec)
            except RuntimeError:  # the pattern as sent: its error's positions are the user's
                xgr.Grammar.from_regex(params.regex)
                raise
            if regex_matches_nothing(spec):  # xgrammar compiles it; its output stops there
                raise ValueError(f"the regex matches no string: {EMPTY_REGEX}")
        elif kind == "structural_tag":
            _check_structural_tag(spec)
        elif kind == "grammar":
            problem = unit_cycle_problem(str(xgr.Grammar.from_ebnf(spec)))
            if problem is not None:  # xgrammar's compiler would crash the process
                raise ValueError(problem)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                "structural_tag": "structural tag"}[kind]
        why = grammar_error(spec, clean_error(e)) if params.kind == "grammar" else clean_error(e)
        if params.kind == "grammar" and spec != params.grammar:
            why += f" (in the GBNF converted from the Lark grammar: {quoted_head(spec)})"
        if params.kind == "choice":
            what = "choice"
        raise ValueError(f"invalid {what} in structured_outputs: {why}") from None
