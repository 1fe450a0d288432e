"""A JSON schema's subschemas and string patterns: the subschemas walked
(:func:`subschemas`) and rewritten (:func:`map_schemas`, :func:`map_patterns`), every string
pattern listed with where it is (:func:`string_patterns`), and the budgets on the patterns'
counted repetitions (:func:`costly_pattern`): quadratic in a count where xgrammar converts the
pattern, linear where kvflow does. The keywords xgrammar accepts but does not enforce are
``schema_support``'s."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(key: str, value: Any) -> list[tuple[str, Any]]:
    """(path, subschema) pairs under ``key: value``, one keyword of a schema object
    (``properties.a``, ``anyOf.0``, ``items``); empty for a keyword that holds no subschemas."""
    if key in _MAP and isinstance(value, dict):
        return [(f"{key}.{name}", sub) for name, sub in value.items()]
    if key in _LIST and isinstance(value, list):
        return [(f"{key}.{i}", sub) for i, sub in enumerate(value)]
    if key in _ONE and isinstance(value, dict):
        return [(key, value)]
    return []


# xgrammar (0.2.9) converts a string pattern's counts ({m}, {m,}, {m,n}) into grammar rules in
# time that grows with the square of each count times the length of what repeats: here
# "^[a-z]{1,3000}$" took 0.33 s, "(abcdefghij){1,2000}" 1.7 s and "^[a-z]{1,50000}$" about
# 95 s, during which the API server's event loop (which validates the schema) and then the
# engine core (which validates it again when the request is added) serve nobody. It still does
# so for the patterns kvflow leaves to it (``patternProperties`` names, the patterns of XML-style
# structural tags): these may cost this much in all (count squared times the repeated text's
# length, summed), about 0.4 s of xgrammar's time here, e.g. one [a-z]{1,3000}.
MAX_PATTERN_REPEAT_COST = 10_000_000
# A JSON-schema ``pattern`` kvflow converts (``json_pattern``, ``utf8_grammar``) costs time
# linear in its counts of what is not one character class (``repeat_counts``' shared blocks:
# "(ab){1,100000}" 0.2 s to convert and 0.1 s to compile for a 49k vocabulary, "a{1,1000000}"
# 1.1 s and 1.1 s), and nothing that grows for a class's count ("[a-z]{1,1000000}\d": 0.03 s
# and 0.08 s; ``benchmarks/pattern_counts.py --grid``): those patterns may cost this much in
# all (each such count's bound times the repeated text's length, summed), and no count may
# pass ``MAX_COUNT`` (the largest measured).
MAX_CONVERTED_REPEAT_COST = 200_000
MAX_COUNT = 1_000_000
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_CLASS_ESCAPES = frozenset("dDwWsS")


def pattern_counts(pattern: str) -> list[tuple[int, int, bool]]:
    """(bound, atom length, one class) of each counted repetition ``{m}``, ``{m,}`` or
    ``{m,n}`` of a regex: the bound n, else m; the length of the repeated atom (a group's
    text with its parentheses; a character, escape or class counts 1); whether the atom is
    one character class (``[...]``, ``.``, ``\\d`` ... ``\\S``). An estimate from the
    text alone (escaped braces are literals, not counts)."""
    counts, atom, one_class, groups, i = [], 1, False, [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            atom, one_class, i = 1, pattern[i + 1:i + 2] in _CLASS_ESCAPES, i + 2
            continue
        if char == "[":  # a class: one character; skip to its closing bracket
            j = i + 2 if pattern[i + 1:i + 2] == "]" else i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom, one_class, i = 1, True, j + 1
            continue
        if char == "(":
            groups.append(i)
        elif char == ")" and groups:
            atom, one_class = i - groups.pop() + 1, False
            i += 1
            continue
        elif char == "{" and (count := _COUNT.match(pattern, i)) is not None:
            low, high = count.group(1), count.group(2)
            counts.append((int(high) if high else int(low), atom, one_class))
            i = count.end()
            continue
        atom, one_class = 1, char == "."
        i += 1
    return counts


def pattern_repeat_cost(pattern: str) -> tuple[int, int]:
    """(cost, largest count) of a regex's counted repetitions as xgrammar converts them: the
    sum over ``{m}``, ``{m,}`` and ``{m,n}`` of (n, else m) squared times the length of the
    repeated atom (:func:`pattern_counts`)."""
    counts = pattern_counts(pattern)
    return (sum(bound * bound * atom for bound, atom, _ in counts),
            max((bound for bound, _, _ in counts), default=0))


def converted_repeat_cost(pattern: str) -> tuple[int, int]:
    """(cost, largest count) of a JSON-schema ``pattern``'s counted repetitions as kvflow
    converts them: the sum of (n, else m) times the repeated atom's length over the counts of
    what is not one character class (:func:`pattern_counts`)."""
    counts = pattern_counts(pattern)
    return (sum(bound * atom for bound, atom, one_class in counts if not one_class),
            max((bound for bound, _, _ in counts), default=0))


def costly_pattern(schema: Any, kvflow_converts: bool = True) -> str | None:
    """Why ``schema`` (a parsed JSON schema) is refused for its patterns' counted
    repetitions, naming the pattern that passes a budget and where it is; None when within
    them. Each ``pattern`` kvflow converts (``kvflow_converts``: not for an XML-style
    structural tag's schema) counts against ``MAX_CONVERTED_REPEAT_COST`` and ``MAX_COUNT``
    (:func:`converted_repeat_cost`), each ``patternProperties`` name and each pattern left to
    xgrammar against ``MAX_PATTERN_REPEAT_COST`` (:func:`pattern_repeat_cost`); subschemas
    included, each budget summed over the schema."""
    totals = {True: 0, False: 0}
    for path, pattern in string_patterns(schema):
        ours = kvflow_converts and path.endswith("pattern")
        cost, largest = (converted_repeat_cost if ours else pattern_repeat_cost)(pattern)
        totals[ours] += cost
        budget = MAX_CONVERTED_REPEAT_COST if ours else MAX_PATTERN_REPEAT_COST
        if totals[ours] > budget or largest > MAX_COUNT:
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            return (f"the pattern {shown!r} at {path} repeats up to {largest} times: "
                    f"{_WHY[ours]}; a length limit alone belongs in minLength / maxLength with "
                    "no pattern (beside a pattern they are refused, not enforced)")
    return None


_WHY = {True: "a count past 1,000,000, or counts of groups and literals past about 200,000 "
              "characters in all, are more than kvflow converts in well under a second "
              "(a character class's count costs nothing below 1,000,000)",
        False: "the grammar engine's conversion time grows with the square of a count, and "
               "this schema's patterns together pass kvflow's budget (about one "
               "[a-z]{1,3000})"}


def map_patterns(schema: Any, rewrite: Callable[[str], str]) -> Any:
    """A copy of ``schema`` (a parsed JSON schema) with every ``pattern`` string of it and
    its subschemas replaced by ``rewrite(pattern)``; other values shared, not copied."""
    def one(sub: dict[str, Any]) -> dict[str, Any]:
        if isinstance(sub.get("pattern"), str):
            return {**sub, "pattern": rewrite(sub["pattern"])}
        return sub
    return map_schemas(schema, one)


def map_schemas(schema: Any, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of ``schema`` (a parsed JSON schema) with it and each of its subschemas (an
    object) replaced by ``rewrite(subschema)``, subschemas first."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: map_schemas(sub, rewrite) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [map_schemas(sub, rewrite) for sub in value]
        elif key in _ONE and isinstance(value, dict):
            out[key] = map_schemas(value, rewrite)
        else:
            out[key] = value
    return rewrite(out)


def string_patterns(schema: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, regex) of every string pattern in ``schema`` (a parsed JSON schema) and its
    subschemas: each ``pattern`` (path ``properties.a.pattern``) and ``patternProperties``
    name (path ``...patternProperties``), in the schema's order."""
    if not isinstance(schema, dict):
        return []
    at = f"{path}." if path else ""
    found = []
    if isinstance(schema.get("pattern"), str):
        found.append((f"{at}pattern", schema["pattern"]))
    if isinstance(schema.get("patternProperties"), dict):
        found += [(f"{at}patternProperties", name) for name in schema["patternProperties"]]
    for key, value in schema.items():
        for sub_path, sub in subschemas(key, value):
            found += string_patterns(sub, f"{at}{sub_path}")
    return found
