"""JSON Schema keywords the grammar engine would accept but not enforce.

xgrammar (0.2.9) compiles a schema using any of these without an error, then lets through
outputs that break them (checked against ``jsonschema`` on violating instances): ``[1, 1]``
under ``uniqueItems``, ``"x"`` under ``{"allOf": [{"type": "integer"}, {"minimum": 5}]}``, an
object missing what ``if``/``then`` or ``dependentRequired`` require. A constraint kvflow
accepts must hold in every output, so such a schema is refused, naming the keyword and where
it is, rather than served as a looser one. Not refused: ``oneOf`` (enforced as ``anyOf``: an
output matching several branches passes) and ``format`` (an annotation in JSON Schema
2020-12; xgrammar enforces the common formats).
"""

from __future__ import annotations

from typing import Any

# keyword -> why it is refused (what xgrammar does with it)
_UNENFORCED = {
    "uniqueItems": "repeated items are not prevented",
    "contains": "arrays without a matching item are not prevented",
    "minContains": "arrays without a matching item are not prevented",
    "maxContains": "arrays with too many matching items are not prevented",
    "not": "the excluded values are not prevented",
    "if": "the then/else branches are not applied",
    "dependentRequired": "the dependent properties are not required",
    "dependentSchemas": "the dependent schemas are not applied",
    "dependencies": "the dependent properties are not required",
}
# keywords that ask for nothing when empty (or 0)
_EMPTY_IS_NOTHING = ("uniqueItems", "dependentRequired", "dependentSchemas", "dependencies")
# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The first keyword of ``schema`` (a parsed JSON schema) and its subschemas that the
    grammar would not enforce, as ``"'uniqueItems' at properties.tags: repeated items are
    not prevented"``; None when there is none. ``path``: where ``schema`` sits (dotted)."""
    if not isinstance(schema, dict):
        return None
    found = _own_keyword(schema)
    if found is not None:
        at = f" at {path}" if path else ""
        return f"{found[0]!r}{at}: {found[1]}"
    for key, value in schema.items():
        for sub_path, sub in _subschemas(key, value):
            where = f"{path}.{sub_path}" if path else sub_path
            found_below = unenforced_keyword(sub, where)
            if found_below is not None:
                return found_below
    return None


def _own_keyword(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(keyword, why) for a keyword of this schema object itself, else None."""
    for key, why in _UNENFORCED.items():
        value = schema.get(key)
        if value is None or value is False or (not value and key in _EMPTY_IS_NOTHING):
            continue
        return key, why
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", "only one of its subschemas is applied"
    if "multipleOf" in schema and schema.get("type") not in ("integer", ["integer"]):
        return "multipleOf", "enforced for type integer only"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref", f"{ref!r} is not in the schema (only '#...' references resolve)"
    return None


def _subschemas(key: str, value: Any) -> list[tuple[str, Any]]:
    """(path, subschema) pairs under ``key`` (a keyword whose value holds subschemas)."""
    if key in _MAP and isinstance(value, dict):
        return [(f"{key}.{name}", sub) for name, sub in value.items()]
    if key in _LIST and isinstance(value, list):
        return [(f"{key}.{i}", sub) for i, sub in enumerate(value)]
    if key in _ONE and isinstance(value, dict):
        return [(key, value)]
    return []
