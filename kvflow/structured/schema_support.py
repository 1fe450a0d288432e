"""JSON Schema keywords the grammar engine would accept but not enforce.

xgrammar (0.2.9) compiles a schema using any of these without an error, then lets through
outputs that break them (checked against ``jsonschema`` on violating instances): ``[1, 1]``
under ``uniqueItems``, ``"x"`` under ``{"allOf": [{"type": "integer"}, {"minimum": 5}]}``, an
object missing what ``if``/``then`` or ``dependentRequired`` require, ``"aaa"`` under
``{"pattern": "^a*$", "maxLength": 2}`` (minLength / maxLength beside a pattern, and beside a
``format`` xgrammar knows, such as ``"date"``). A
constraint kvflow accepts must hold in every output, so such a schema is refused, naming the keyword and where
it is, rather than served as a looser one. So is a schema that asks what xgrammar drops:

- a keyword beside the one of ``_ALONE`` (``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``,
  ``allOf``) that xgrammar builds the schema object from alone: ``7`` passes
  ``{"$ref": "#/$defs/n", "maximum": 5}``, ``1`` passes ``{"anyOf": [...], "type": "string"}``;
- a ``required`` name missing from ``properties``: ``{}`` passes ``{"required": ["x"]}``;
- an empty ``anyOf`` / ``oneOf``: its grammar takes text that is not JSON, ``{"a": }``;
- ``propertyNames`` beside ``properties`` (the listed names pass unchecked) or beside
  ``"additionalProperties": false`` (the names it allows pass, with any value), and a
  ``patternProperties`` pattern matching a listed name (only the listed schema applies);
- a ``pattern`` beside a ``format`` xgrammar enforces (the format alone applies);
- a ``minProperties`` that repeated unlisted names could meet (``{"x": 1, "x": 2}`` passes 2);
- a fractional ``multipleOf`` (``2`` passes 2.5), or one beside a single bound or bounds
  ``_MULTIPLE_SPAN`` or more integers apart (``4`` passes 3 with ``"minimum": 0``);
- a keyword of one type (``_ONE_TYPE``: ``minimum``, ``maxLength``, ``maxItems``, ...) in a
  schema object that names no ``type`` and none xgrammar reads from ``properties`` /
  ``items`` (and the like): ``1`` passes ``{"minimum": 3}``.

Not refused: ``oneOf`` (enforced as ``anyOf``: an
output matching several branches passes) and ``format`` (an annotation in JSON Schema
2020-12; xgrammar enforces the formats in ``LENGTHLESS_FORMATS`` and ignores the others).

The budget on a schema's counted repetitions in string patterns (``costly_pattern``), and
the walk over its subschemas, are ``schema_patterns``'.
"""

from __future__ import annotations

import re
from typing import Any

from kvflow.structured.schema_patterns import subschemas

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
# xgrammar (0.2.9) drops a string's minLength / maxLength when it also has a pattern (it logs
# "pattern combined with minLength/maxLength is not supported"): "aaa" passes
# {"pattern": "^a*$", "maxLength": 2}. Found by benchmarks/xgrammar_crash_fuzz.py.
_WITH_PATTERN = ("not enforced together with 'pattern' (write the length into the pattern, "
                 "e.g. ^[a-z]{3,8}$)")
# The string formats xgrammar (0.2.9) enforces, and for which it drops minLength / maxLength
# (it logs "format combined with minLength/maxLength is not supported"): "2024-01-02" passes
# {"format": "date", "maxLength": 3}. Checked one by one; other format names (idn-email, iri,
# regex, unknown ones) are ignored by xgrammar and the lengths are enforced.
LENGTHLESS_FORMATS = frozenset((
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"))
# keywords that ask for nothing when empty (or 0)
_EMPTY_IS_NOTHING = ("uniqueItems", "dependentRequired", "dependentSchemas", "dependencies")
# The keywords that assert something of a value (JSON Schema 2020-12's applicator and
# validation vocabularies, draft 7's ``dependencies`` and ``additionalItems``); any other key
# (title, description, default, examples, $defs, format, unknown names) is an annotation.
_ASSERTIONS = frozenset((
    "$ref", "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties", "required",
    "dependentRequired", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "items", "prefixItems", "additionalItems", "contains", "unevaluatedItems",
    "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "dependentSchemas",
    "dependencies"))
# xgrammar (0.2.9) builds a schema object from the first of these it has, alone, and drops
# every other keyword beside it (checked one by one against jsonschema's verdicts):
# {"$ref": "#/$defs/n", "maximum": 5} takes 7, {"anyOf": [...], "type": "string"} takes 1,
# {"enum": ["a", "bbbb"], "maxLength": 2} takes "bbbb", {"const": "a", "type": "integer"} "a".
_ALONE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_JSON_TYPES = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
               "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
               "string": lambda v: isinstance(v, str),
               "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
               "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or
               (isinstance(v, float) and v.is_integer())}

def unenforced_keyword(schema: Any, path: str = "", names: bool = False) -> str | None:
    """The first keyword of ``schema`` (a parsed JSON schema) and its subschemas that the
    grammar would not enforce, as ``"'uniqueItems' at properties.tags: repeated items are
    not prevented"``; None when there is none. ``path``: where ``schema`` sits (dotted);
    ``names``: ``schema`` is a ``propertyNames`` one (its values are strings, typed or not)."""
    if not isinstance(schema, dict):
        return None
    found = _own_keyword(schema, names)
    if found is not None:
        at = f" at {path}" if path else ""
        return f"{found[0]!r}{at}: {found[1]}"
    for key, value in schema.items():
        for sub_path, sub in subschemas(key, value):
            where = f"{path}.{sub_path}" if path else sub_path
            found_below = unenforced_keyword(sub, where, key == "propertyNames")
            if found_below is not None:
                return found_below
    return None


def _own_keyword(schema: dict[str, Any], names: bool = False) -> tuple[str, str] | None:
    """(keyword, why) for a keyword of this schema object itself (``names``: a
    ``propertyNames`` schema), else None."""
    for key, why in _UNENFORCED.items():
        value = schema.get(key)
        if value is None or value is False or (not value and key in _EMPTY_IS_NOTHING):
            continue
        return key, why
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", "only one of its subschemas is applied"
    if "multipleOf" in schema and schema.get("type") not in ("integer", ["integer"]):
        return "multipleOf", "enforced for type integer only"
    multiple = schema.get("multipleOf")
    if isinstance(multiple, float) and not multiple.is_integer():  # 2 passed 2.5
        return "multipleOf", "enforced for whole numbers only"
    if multiple is not None and not _multiple_kept(schema):
        return "multipleOf", (f"enforced with no bounds, or with both within {_MULTIPLE_SPAN:,} "
                              "integers, only (4 passed a multipleOf of 3 with a minimum)")
    if isinstance(schema.get("pattern"), str) and schema.get("format") in LENGTHLESS_FORMATS:
        return "pattern", (f"not enforced together with format {schema['format']!r}, which "
                           "the grammar applies alone (write the format as the pattern)")
    if _min_properties_by_repeats(schema):  # {"x": 1, "x": 2} passed minProperties 2
        return "minProperties", ("counted with repeated names: the grammar does not keep the "
                                 "names of unlisted properties unique, and a JSON parser keeps "
                                 "one of each")
    shadowed = _shadowed_pattern_property(schema)
    if shadowed is not None:
        return "patternProperties", shadowed
    length = _length_keyword(schema)
    if length is not None and isinstance(schema.get("pattern"), str):
        return length, _WITH_PATTERN
    if length is not None and schema.get("format") in LENGTHLESS_FORMATS:
        return length, (f"not enforced together with format {schema['format']!r} (write the "
                        "format and the length as one pattern instead)")
    untyped = None if names else _untyped_keyword(schema)
    if untyped is not None:
        return untyped
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref", f"{ref!r} is not in the schema (only '#...' references resolve)"
    for key in ("anyOf", "oneOf"):
        if schema.get(key) == []:  # xgrammar's grammar takes the empty text ({"a": } inside)
            return key, ("an empty list matches no value, and the grammar lets text that is "
                         "not JSON through")
    if not _asserts_nothing("propertyNames", schema.get("propertyNames", True)):
        if schema.get("properties"):
            return "propertyNames", "the names under 'properties' are not checked against it"
        if schema.get("additionalProperties") is False:  # {"a": "x"} passed
            return "propertyNames", ("beside additionalProperties false, the grammar lets "
                                     "properties through that it allows, with any value")
    return _dropped_sibling(schema) or _unlisted_required(schema)


# keywords that assert something of one JSON type only. xgrammar (0.2.9) applies them where
# the schema names a type, or where it reads one from _TYPE_READ_FROM (it then writes only
# values of that type); else it writes any value and drops them: 1 passed {"minimum": 3},
# "abc" {"maxLength": 2}, [1, 2] {"maxItems": 1}, {} {"minProperties": 1}
_ONE_TYPE = {"minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
             "exclusiveMaximum": "number", "minLength": "string", "maxLength": "string",
             "pattern": "string", "minItems": "array", "maxItems": "array",
             "minProperties": "object", "maxProperties": "object",
             "patternProperties": "object", "propertyNames": "object"}
_TYPE_READ_FROM = ("properties", "additionalProperties", "unevaluatedProperties", "items",
                   "prefixItems", "unevaluatedItems")


def _untyped_keyword(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(keyword, why) for a keyword of ``_ONE_TYPE`` in a schema object that names no type
    and from which xgrammar reads none (one with a ``_ALONE`` keyword is
    :func:`_dropped_sibling`'s), else None."""
    if "type" in schema or any(key in schema for key in _ALONE + _TYPE_READ_FROM):
        return None
    for key, value in schema.items():
        if key in _ONE_TYPE and not _asserts_nothing(key, value):
            kind = _ONE_TYPE[key]
            return key, (f"enforced only with a 'type' (the schema names none, so the grammar "
                         f"writes any value): add \"type\": \"{kind}\"")
    return None


def _dropped_sibling(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(keyword, why) for a keyword that asserts something beside the one of ``_ALONE``
    xgrammar builds the schema object from (it is dropped), else None. A ``type`` beside an
    ``enum`` / ``const`` whose values all have that type asks nothing more (pydantic writes
    ``{"enum": [...], "type": "string"}``); keywords that ask for nothing are skipped."""
    lead = next((key for key in _ALONE if key in schema), None)
    if lead is None:
        return None
    for key, value in schema.items():
        if key == lead or key not in _ASSERTIONS or _asserts_nothing(key, value):
            continue
        if key == "type" and lead in ("const", "enum") and _values_typed(schema, lead):
            continue
        return key, (f"dropped beside {lead!r}, which the grammar applies alone "
                     f"({_HINTS[lead]})")
    return None


_HINTS = {"$ref": "move it into the referenced schema", "anyOf": "move it into each branch",
          "oneOf": "move it into each branch", "allOf": "move it into its subschema",
          "const": "the value is not checked against it", "enum": "the values are not "
          "checked against it: list only values that meet it"}


def _asserts_nothing(key: str, value: Any) -> bool:
    """Whether ``key: value`` constrains no value (``uniqueItems: false``, an empty
    ``required`` / ``properties``, a ``minLength`` of 0, ``additionalProperties: true``)."""
    if value is True and key not in ("uniqueItems", "const", "enum"):
        return True  # a subschema that allows everything
    if key in ("minLength", "minItems", "minProperties", "minContains") and value == 0:
        return True
    return value in ({}, []) or (key == "uniqueItems" and value is False)


def _values_typed(schema: dict[str, Any], lead: str) -> bool:
    """Whether every value of the ``enum`` / ``const`` ``lead`` has one of the schema's
    ``type`` names (an unknown name matches nothing)."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    values = [schema["const"]] if lead == "const" else schema["enum"]
    if not isinstance(values, list):
        return False
    checks = [_JSON_TYPES[t] for t in types if isinstance(t, str) and t in _JSON_TYPES]
    return all(any(check(v) for check in checks) for v in values)


def _unlisted_required(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(``"required"``, why) when a ``required`` name is missing from ``properties``:
    xgrammar requires only listed properties (``{}`` passes ``{"required": ["x"]}``, with
    ``additionalProperties`` or ``patternProperties`` beside it too), else None."""
    required, listed = schema.get("required"), schema.get("properties")
    if not isinstance(required, list):
        return None
    listed = listed if isinstance(listed, dict) else {}
    missing = [name for name in required if name not in listed]
    if not missing:
        return None
    return "required", (f"{missing[0]!r} is not under 'properties', and the grammar requires "
                        "only the properties listed there (list it under 'properties')")


# xgrammar (0.2.9) keeps an integer's multipleOf alone, or between a lower and an upper bound
# at most this many integers apart (it lists them); with one bound, or wider ones, it drops it
_MULTIPLE_SPAN = 10_000


def _multiple_kept(schema: dict[str, Any]) -> bool:
    """Whether xgrammar enforces the ``multipleOf`` of this integer schema: no bound, or
    inclusive bounds fewer than ``_MULTIPLE_SPAN`` apart."""
    lows = [schema[k] + (k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum")
            if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)]
    highs = [schema[k] - (k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum")
             if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)]
    if not lows and not highs:
        return True
    return bool(lows and highs) and min(highs) - max(lows) < _MULTIPLE_SPAN


def _min_properties_by_repeats(schema: dict[str, Any]) -> bool:
    """Whether ``minProperties`` may be met by repeating a name: names not under
    ``properties`` are allowed (xgrammar keeps listed names unique, not the others), and it
    asks for more than the required listed properties and one other name (a name repeated
    still counts once, so one more is always met)."""
    least = schema.get("minProperties")
    if not isinstance(least, int) or isinstance(least, bool):
        return False
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    others = schema.get("additionalProperties") is not False or \
        bool(schema.get("patternProperties"))
    return others and least > len(set(required) & set(listed)) + 1


def _shadowed_pattern_property(schema: dict[str, Any]) -> str | None:
    """Why ``patternProperties`` are not enforced on a name listed under ``properties`` that
    one of them also matches (JSON Schema applies both schemas; xgrammar only the listed
    one), or None. Patterns are read with Python's ``re`` (one it refuses is skipped)."""
    listed, patterns = schema.get("properties"), schema.get("patternProperties")
    if not isinstance(listed, dict) or not isinstance(patterns, dict):
        return None
    for pattern in patterns:
        try:
            matched = [name for name in listed if re.search(pattern, name)]
        except re.error:
            continue
        if matched:
            return (f"{pattern!r} also matches {matched[0]!r}, listed under 'properties', "
                    "whose schema the grammar applies alone")
    return None


def _length_keyword(schema: dict[str, Any]) -> str | None:
    """``"minLength"`` or ``"maxLength"`` if the schema object limits a string's length (a
    minLength of 0 limits nothing), else None."""
    for key in ("minLength", "maxLength"):
        if key in schema and not (key == "minLength" and schema[key] == 0):
            return key
    return None
