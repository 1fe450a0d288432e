"""A JSON schema's subschemas and string patterns: the subschemas walked
(:func:`subschemas`) and rewritten (:func:`map_schemas`, :func:`map_patterns`), every string
pattern listed with where it is (:func:`string_patterns`), and the budget on the patterns'
counted repetitions (:func:`costly_pattern`), which xgrammar converts in time quadratic in the
count. The keywords xgrammar accepts but does not enforce are ``schema_support``'s."""

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


# xgrammar (0.2.9) converts a string ``pattern`` ({m}, {m,}, {m,n}) into grammar rules in time
# that grows with the square of each count times the length of what repeats: here
# "^[a-z]{1,3000}$" takes 0.33 s, "(abcdefghij){1,2000}" 1.7 s and "^[a-z]{1,50000}$" about
# 95 s, during which the API server's event loop (which validates the schema) and then the
# engine core (which validates it again when the request is added) serve nobody. A schema's
# patterns may cost this much in all (count squared times the repeated text's length, summed):
# about 0.4 s of xgrammar's time here, e.g. one [a-z]{1,3000}. Length limits belong in
# minLength / maxLength, which cost nothing.
MAX_PATTERN_REPEAT_COST = 10_000_000
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_repeat_cost(pattern: str) -> tuple[int, int]:
    """(cost, largest count) of a regex's counted repetitions: the sum over ``{m}``,
    ``{m,}`` and ``{m,n}`` of (n, else m) squared times the length of the repeated atom (a
    group's text with its parentheses; a character, escape or class counts 1). An estimate
    from the text alone (escaped braces are literals, not counts)."""
    cost, largest, atom, groups, i = 0, 0, 1, [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            atom, i = 1, i + 2
            continue
        if char == "[":  # a class: one character; skip to its closing bracket
            j = i + 2 if pattern[i + 1:i + 2] == "]" else i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom, i = 1, j + 1
            continue
        if char == "(":
            groups.append(i)
        elif char == ")" and groups:
            atom = i - groups.pop() + 1
            i += 1
            continue
        elif char == "{" and (count := _COUNT.match(pattern, i)) is not None:
            low, high = count.group(1), count.group(2)
            bound = int(high) if high else int(low)
            cost, largest = cost + bound * bound * atom, max(largest, bound)
            i = count.end()
            continue
        atom = 1
        i += 1
    return cost, largest


def costly_pattern(schema: Any) -> str | None:
    """Why ``schema`` (a parsed JSON schema) is refused for its patterns' counted
    repetitions (``MAX_PATTERN_REPEAT_COST``, summed over every ``pattern`` and
    ``patternProperties`` name, subschemas included), naming the pattern that passes the
    budget and where it is; None when within it."""
    total = 0
    for path, pattern in string_patterns(schema):
        cost, largest = pattern_repeat_cost(pattern)
        total += cost
        if total > MAX_PATTERN_REPEAT_COST:
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            return (f"the pattern {shown!r} at {path} repeats up to {largest} times: the "
                    "grammar engine's conversion time grows with the square of a count, and "
                    "this schema's patterns together pass kvflow's budget (about one "
                    "[a-z]{1,3000}); a length limit alone belongs in minLength / maxLength with "
                    "no pattern (beside a pattern they are refused, not enforced)")
    return None


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
