"""Span scanning over (possibly incomplete) JSON text, as the tool-call parsers read a
model's output: where a string, value or object ends, without parsing it with a JSON grammar
(the text may be cut anywhere while streaming)."""

from __future__ import annotations

import json


def skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """``text[i] == '"'``; index after the closing quote, or None if the text ends first."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End index of the JSON value starting at ``text[i]``, or None if it is not complete
    (a bare number or literal is complete only once a delimiter follows it)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _scan_string(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;<":
        j += 1
    return j if j < len(text) else None


def _key(literal: str) -> str:
    """A member name from its JSON string literal; one that is not valid JSON (a model wrote
    a bad escape or a raw control character) is kept as its raw text, which names no member
    a parser looks for, instead of raising."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return literal


def object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Members of the (possibly incomplete) JSON object at ``text[i] == '{'``: key ->
    (value start, value end or None), in the text's order, and the object's end index or None.
    A key written twice keeps its first value: what the object's text so far says never changes
    as more text comes (a stream already sent the first)."""
    members: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        key_end = _scan_string(text, i) if text[i] == '"' else None
        if key_end is None:
            return members, None
        key = _key(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members, None
        start = skip_ws(text, i + 1)
        if start >= len(text):
            return members, None
        end = scan_value(text, start)
        members.setdefault(key, (start, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
    return members, None
