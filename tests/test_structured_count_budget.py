r"""The compile budget on a class's count right before a character the class also matches
(``count_budget``): which counts it finds (``count_budget.overlapping_class_counts``), what
it charges (hand-counted tokens), and the refusal past it, on the tiny vocabulary with the
budget lowered and on SmolLM2's 49k one as served. Before, ``.{1,300}\d`` compiled for
5-15 s on a compile thread (``docs/benchmarks.md``); now it is refused at once, naming why.
Oracles: Python's ``re`` on the counted class's characters, hand-counted token lists, and
``re.fullmatch`` over the strings a grammar within the budget takes."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from kvflow.structured import StructuredOutputsParams, count_budget
from kvflow.structured.count_budget import (
    MAX_OVERLAP_COST,
    OverlapBudget,
    expansion_weight,
    overlapping_class_counts,
)
from kvflow.structured.utf8_grammar import printed_ebnf
from kvflow.structured.xgrammar_convert import json_schema_grammar, regex_text


def _json_ebnf(*patterns: str) -> str:
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)},
        "required": [f"p{i}" for i in range(len(patterns))]}
    return printed_ebnf(json_schema_grammar(json.dumps(schema)))


def _regex_ebnf(pattern: str) -> str:
    from kvflow.structured.utf8_grammar import regex_grammar

    return printed_ebnf(regex_grammar(xgr.Grammar.from_regex(regex_text(pattern))))


PROBES = ["a", "z", "A", "0", "9", "-", "@", ".", "é", "\"", "\\", "\n", " "]


def _members(ranges: list[tuple[int, int]]) -> set[str]:
    return {c for c in PROBES if any(low <= ord(c) <= high for low, high in ranges)}


@pytest.mark.parametrize("pattern, counted, bounds", [
    (r"^.{1,300}\d$", r"[^\"\\\x00-\x1f]", (1, 300)),  # a JSON string's "." before a digit
    (r"^.{1,300}@$", r"[^\"\\\x00-\x1f]", (1, 300)),  # before a literal it matches
    (r"^[a-z0-9-]{0,61}[a-z0-9]$", r"[a-z0-9-]", (0, 61)),
    (r"^x{3}[a-z]{2,}[a-c]$", r"[a-z]", (2, -1)),  # unbounded
    (r"^[a-z]{1,300}\d$", None, 0),  # disjoint: literal alternatives
    (r"^[a-z]{1,300}@$", None, 0),  # a literal outside the class: xgrammar's cheap case
    (r"^.{1,300}$", None, 0),  # before the string's closing quote
    (r"^(ab){1,300}b$", None, 0),  # a group's count: repeat_counts' blocks
])
def test_overlapping_counts_are_found(pattern, counted, bounds):
    """Each JSON-schema pattern's overlapping count, its class's characters as Python's re
    reads the class (among ``PROBES``) and its bounds; none where the count is followed by
    a class it does not overlap, a literal outside it, the closing quote, or is a group's."""
    found = overlapping_class_counts(_json_ebnf(pattern))
    if counted is None:
        assert found == []
        return
    assert [(low, high) for _, low, high in found] == [bounds]
    assert _members(found[0][0]) == {c for c in PROBES if re.fullmatch(counted, c)}


def test_every_pattern_of_a_schema_counts_once_and_regexes_too():
    """Two properties' patterns: two counts (the pattern's own rule, left unreached once
    its body sits between the quotes, is not counted again); a ``regex`` constraint's
    ``.`` (no newline) before a digit; a regex ending in its count (no follower) none."""
    assert [high for _, _, high in overlapping_class_counts(
        _json_ebnf(r"^.{1,300}\d$", r"^.{1,30}\d$"))] == [300, 30]
    found = overlapping_class_counts(_regex_ebnf(r"x.{1,300}\d"))
    assert [(low, high) for _, low, high in found] == [(1, 300)]
    assert _members(found[0][0]) == set(PROBES) - {"\n"}
    assert overlapping_class_counts(_regex_ebnf(r".{1,300}")) == []


def test_cost_is_the_count_times_the_tokens_the_class_begins():
    """Hand-counted: of these tokens, 3 begin with a lowercase letter (``a``, ``ab``,
    ``q1``), 2 with a digit; an empty token and a lone UTF-8 lead byte begin with none.
    A count's weight (in half checks) by hand from xgrammar's expansion: ``{1,5}`` one
    unrolled repetition (1) and 4 nested rules (8); ``{0,9}`` 9 nested (18)."""
    budget = OverlapBudget([b"a", b"ab", b"q1", b"1", b"12", b" x", b"", b"\xe4", "é".encode()])
    assert budget.tokens_in([(ord("a"), ord("z"))]) == 3
    assert budget.tokens_in([(ord("0"), ord("9")), (ord("a"), ord("b"))]) == 4
    assert budget.cost(_json_ebnf(r"^[a-z]{1,5}[a-e]$")) == ((1 + 8) * 3 // 2, 5)
    # past 128: {1,127} as above (1 + 2 x 126), then the repeat (2) and 128 unrolled
    assert budget.cost(_json_ebnf(r"^[a-z]{1,300}[a-e]$", r"^\d{0,9}[0-5]$")) == \
        ((1 + 252 + 2 + 128) * 3 // 2 + 18 * 2 // 2, 300)
    assert budget.cost(_json_ebnf(r"^[a-z]{1,300}\d$")) == (0, 0)


@pytest.mark.parametrize("low, high, weight", [
    (1, 5, 1 + 2 * 4), (0, 128, 2 * 128), (120, 128, 120 + 2 * 8), (128, 128, 128),
    (200, 300, 2 + 128), (150, 150, 2 + 128), (128, 300, 2 + 128),
    (1, 300, 1 + 2 * 126 + 2 + 128), (0, 129, 2 * 127 + 2 + 128),
    (2, -1, 2 + 2), (500, -1, 2 + 128),
])
def test_expansion_weight_follows_xgrammars_expansion(low, high, weight):
    """Half checks per token, by hand: an unrolled repetition 1, a nested rule 2. Only the
    optional part is nested up to 128 (``{120,128}``: 8); past 128 a lower bound of 128 or
    more leaves one repeat and the last 128 unrolled (``{200,300}``: 130 where
    ``min(count, 128)`` charged 256, the same as ``{1,128}``), a lower one adds
    ``{low,127}``."""
    assert expansion_weight(low, high) == weight


@pytest.fixture(scope="module")
def backend(tiny_llama):
    from transformers import AutoTokenizer

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def test_past_the_budget_the_backend_refuses_before_compiling(backend, monkeypatch):
    """The tiny vocabulary (320 tokens) with the budget lowered to 1,000 token checks
    (``.{1,40}\\d``: 40 x 156 tokens):
    a JSON schema, a regex and an EBNF grammar holding one are refused (the message says
    why and what compiles at once); the disjoint form compiles and takes ``re.fullmatch``'s
    strings; a count within the budget compiles."""
    monkeypatch.setattr(count_budget, "MAX_OVERLAP_COST", 1000)
    for params in (StructuredOutputsParams(json={"type": "string", "pattern": r"^.{1,40}\d$"}),
                   StructuredOutputsParams(regex=r"[a-z]{1,40}[a-c]"),
                   StructuredOutputsParams(grammar='root ::= [a-z]{1,40} [a-c] "x"')):
        with pytest.raises(ValueError, match=r"right before a character that class also "
                                             r"matches .*\(\[\^0-9\]\{1,300\}\\d compiles"):
            backend.compile(params)
    compiled = backend.compile(StructuredOutputsParams(regex=r"[^0-9]{1,40}[0-9]"))
    for value in ["a1", "ab", "1", "x" * 40 + "5", "x" * 41 + "5", "a\n5", "12"]:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(value.encode()) and matcher.is_terminated()
        assert got == (re.fullmatch(r"[^0-9]{1,40}[0-9]", value) is not None), value
    # 2 counts times the tokens that begin with a-z: at most 2 x 320, within 1000
    backend.compile(StructuredOutputsParams(regex=r"[a-z]{1,2}[a-c]"))


def test_served_vocabulary_refuses_the_slow_counts_and_keeps_the_cheap_ones():
    """On SmolLM2's 49k vocabulary (the packaged model's tokenizer, as served): one count of
    any class is within the budget (``.{1,300}\\d``: 128 x 48,657 tokens, measured at 8 s, within
    the 30 s compile timeout), four such counts in one schema (about 32 s) are past it, and
    the counts measured at 2 s or less stay far within (``docs/benchmarks.md``)."""
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model
    from kvflow.structured.text_tokens import special_token_ids, text_tokenizer_info

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), None)
    info = text_tokenizer_info(xgr.TokenizerInfo.from_huggingface(tokenizer),
                               special_token_ids(tokenizer))
    budget = OverlapBudget(info.decoded_vocab)
    assert budget.cost(_json_ebnf(*[r"^.{1,300}\d$"] * 4))[0] > MAX_OVERLAP_COST
    assert budget.cost(_json_ebnf(r"^.{1,100}\.$", r"^.{1,300}@$", r"^.{1,300}\d$",
                                  r"^.{1,64}\d$"))[0] > MAX_OVERLAP_COST
    for single in (r"^.{1,300}\d$", r"^[a-zA-Z ]{1,300}[a-z]$", r"^.{1,100}\.$"):
        assert budget.cost(_json_ebnf(single))[0] <= MAX_OVERLAP_COST, single
    for cheap in (r"^[a-z]{1,300}[aeiou]$", r"^\w{1,300}\d$", r"^[0-9]{1,300}[0-9]$",
                  r"^[a-zA-Z0-9][a-zA-Z0-9-]{0,61}[a-zA-Z0-9]$", r"^.{1,20}\d$"):
        assert budget.cost(_json_ebnf(cheap))[0] <= MAX_OVERLAP_COST / 4, cheap
