"""Structural tags (vLLM's ``structural_tag`` constraint, xgrammar's format), read and
checked without a grammar engine.

A structural tag lets the model write free text until a *trigger* string appears; the text
must then continue with one of the structures that trigger begins: its ``begin`` string, a
JSON value valid for its ``schema``, and its ``end`` string; then free text again (xgrammar,
"Structural Tag Usage"). Two spellings:

- the legacy one (vLLM's ``response_format`` ``{"type": "structural_tag", "structures":
  [{"begin", "schema", "end"}, ...], "triggers": [...]}``), checked here field by field, so
  that an error names the field (``structures.1.begin``);
- xgrammar's newer one, ``{"type": "structural_tag", "format": {...}}`` (``triggered_tags``,
  ``tag``, ``json_schema``, ``regex``, ``grammar``, ``any_text``, ``sequence``, ``or``, ...):
  passed to xgrammar as written; only its ``triggered_tags`` get the trigger checks below
  (xgrammar's own error for a trigger without a tag is an internal check failure).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

_LEGACY_FIELDS = ("type", "structures", "triggers")
_STRUCTURE_FIELDS = ("begin", "schema", "end")
# format types whose ``json_schema`` field is a JSON schema (xgrammar's JSON converter reads it)
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


class StructuralTagError(ValueError):
    """A bad structural tag; ``path`` names the field inside it (``structures.0.begin``,
    ``format.tags.1``; empty for the whole tag)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}" if path else why)
        self.path = path


def parse(spec: str) -> dict[str, Any]:
    """The structural tag in ``spec`` (JSON text).

    Raises:
        StructuralTagError: for text that is not JSON, not a JSON object, or whose ``type``
            is not ``structural_tag``.
    """
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise StructuralTagError("", f"not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise StructuralTagError("", f"must be a JSON object, got {type(tag).__name__}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError("type", f"must be 'structural_tag', got {tag['type']!r}")
    return tag


def is_legacy(tag: dict[str, Any]) -> bool:
    """True for the ``structures`` + ``triggers`` spelling, False for ``format``."""
    return "format" not in tag


def check_legacy(tag: dict[str, Any]) -> None:
    """Check a legacy structural tag's shape: ``triggers`` a non-empty list of non-empty
    strings, ``structures`` a non-empty list of objects with a string ``begin`` and ``end``
    and a JSON-schema ``schema`` (an object, or ``true``), no other fields, and the trigger
    rules of :func:`check_triggers`. Whether each schema compiles is the backend's check.

    Raises:
        StructuralTagError: naming the first bad field and why.
    """
    _no_unknown(tag, _LEGACY_FIELDS, "")
    triggers = tag.get("triggers")
    if triggers is None:
        raise StructuralTagError("triggers", "missing: the strings that start a structure")
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise StructuralTagError("triggers", "must be a non-empty list of non-empty strings")
    structures = tag.get("structures")
    if structures is None:
        raise StructuralTagError("structures", "missing: the begin / schema / end structures")
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structures", "must be a non-empty list of objects")
    for i, structure in enumerate(structures):
        _check_structure(structure, f"structures.{i}")
    check_triggers(triggers, [s["begin"] for s in structures], "structures", "triggers")


def _check_structure(structure: Any, path: str) -> None:
    if not isinstance(structure, dict):
        raise StructuralTagError(path, "must be an object with begin, schema and end")
    _no_unknown(structure, _STRUCTURE_FIELDS, path)
    for name in _STRUCTURE_FIELDS:
        if name not in structure:
            raise StructuralTagError(f"{path}.{name}", "missing")
    for name in ("begin", "end"):
        if not isinstance(structure[name], str):
            raise StructuralTagError(f"{path}.{name}", "must be a string")
    schema = structure["schema"]
    if schema is False:
        raise StructuralTagError(f"{path}.schema", "is false, a schema no value matches")
    if not isinstance(schema, (dict, bool)):
        raise StructuralTagError(f"{path}.schema", "must be a JSON schema (an object)")


def check_triggers(triggers: list[str], begins: list[Any], tags_path: str,
                   triggers_path: str) -> None:
    """Each tag's ``begin`` (a string; a token begin is skipped) starts with exactly one
    trigger, and each trigger starts at least one ``begin`` (xgrammar dispatches on the
    trigger, then needs the rest of one begin). ``tags_path`` / ``triggers_path`` name the
    lists in errors.

    Raises:
        StructuralTagError: at ``<tags_path>.N.begin`` or ``<triggers_path>.N``.
    """
    used = set()
    for i, begin in enumerate(begins):
        if not isinstance(begin, str):
            continue
        matched = [t for t in triggers if begin.startswith(t)]
        if len(matched) != 1:
            why = "starts with none of" if not matched else f"starts with {len(matched)} of"
            raise StructuralTagError(f"{tags_path}.{i}.begin",
                                     f"{begin!r} {why} the triggers {triggers} (each begin "
                                     "must start with exactly one trigger)")
        used.add(matched[0])
    for i, trigger in enumerate(triggers):
        if trigger not in used:
            raise StructuralTagError(f"{triggers_path}.{i}", f"the trigger {trigger!r} starts "
                                     "no begin: after it nothing could follow")


def check_format(tag: dict[str, Any]) -> None:
    """Check what xgrammar leaves to an internal assertion in a ``format`` structural tag:
    the trigger rules (:func:`check_triggers`) of each ``triggered_tags`` in it.

    Raises:
        StructuralTagError: as :func:`check_triggers`, under ``format...``.
    """
    for path, node in _nodes(tag.get("format"), "format"):
        if node.get("type") != "triggered_tags":
            continue
        triggers, tags = node.get("triggers"), node.get("tags")
        if isinstance(triggers, list) and isinstance(tags, list) and \
                all(isinstance(t, str) for t in triggers):
            begins = [t.get("begin") if isinstance(t, dict) else None for t in tags]
            check_triggers(triggers, begins, f"{path}.tags", f"{path}.triggers")


def format_schemas(tag: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(path, node)`` for each format inside a ``format`` structural tag that holds a JSON
    schema (its ``json_schema``: the ``json_schema`` and ``qwen_xml_parameter`` formats);
    ``path`` names the schema (``format.tags.0.content.json_schema``)."""
    for path, node in _nodes(tag.get("format"), "format"):
        if node.get("type") in _SCHEMA_FORMATS and "json_schema" in node:
            yield f"{path}.json_schema", node


def grammar_formats(tag: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``grammar`` formats (EBNF or Lark text) inside a ``format`` structural tag."""
    return [node for _, node in _nodes(tag.get("format"), "format")
            if node.get("type") == "grammar"]


def regex_formats(tag: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(path, node)`` for each ``regex`` format (its ``pattern`` a string) inside a
    ``format`` structural tag."""
    return [(path, node) for path, node in _nodes(tag.get("format"), "format")
            if node.get("type") == "regex" and isinstance(node.get("pattern"), str)]


def _nodes(value: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object in a format tree (JSON schemas not entered), with its path."""
    if isinstance(value, dict):
        yield path, value
        for key, child in value.items():
            if key != "json_schema":
                yield from _nodes(child, f"{path}.{key}")
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _nodes(child, f"{path}.{i}")


def _no_unknown(value: dict[str, Any], known: tuple[str, ...], path: str) -> None:
    unknown = [key for key in value if key not in known]
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise StructuralTagError(where, f"unknown field (expected {', '.join(known)})")
