"""One pydantic validation error in a request's words, shared by the server's 400s
(kvflow/entrypoints/validation_errors.py) and ``LLM.chat``'s checks of the same fields
(kvflow/chat/tool_calls.py), so both say the same thing: the field's limit and what was sent
(``at least 1 character, got 0``), not pydantic's wording, and OpenAI's error code for it.
Pure functions of pydantic's error dicts (``ValidationError.errors()``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["TYPE_WORDS", "at_key", "error_code", "field_message", "in_plain_words",
           "sent_value"]


def field_message(loc: Sequence[str], error: dict) -> str:
    """The message for ``error`` at the field whose path is ``loc`` (``param`` is
    ``".".join(loc)``): OpenAI's words for a key an object does not declare (``Unrecognized
    request argument supplied: <param>``), else ``<param>: <in_plain_words>``; a dict key's
    error names the dict (``logit_bias: ...``)."""
    param = ".".join(loc)
    if error.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    where = ".".join(loc[:-1]) if at_key(error) and len(loc) > 1 else param
    return f"{where}: {in_plain_words(error)}"


def in_plain_words(error: dict) -> str:
    """What is wrong with the value, in the request's terms: the limit and what was sent
    (``at most 16 key-value pairs, got 17``), not pydantic's wording ("Dictionary should have
    at most 16 items after validation, not more"); pydantic's message for the other kinds."""
    kind, ctx, value = str(error.get("type", "")), error.get("ctx") or {}, error.get("input")
    if kind in ("too_long", "too_short"):
        noun = "key-value pair" if ctx.get("field_type") == "Dictionary" else "item"
        limit = ctx["max_length"] if kind == "too_long" else ctx["min_length"]
        got = len(value) if isinstance(value, dict | list | tuple | set) else \
            ctx.get("actual_length")
        bound = "at most" if kind == "too_long" else "at least"
        return f"{bound} {_count(limit, noun)}, got {got}"
    if kind in ("string_too_long", "string_too_short"):
        bound, limit = ("at most", ctx["max_length"]) if kind.endswith("long") else \
            ("at least", ctx["min_length"])
        of = " per key" if at_key(error) else ""
        return f"{bound} {_count(limit, 'character')}{of}, got {len(str(value))}"
    if kind in _BOUNDS:
        return f"{_BOUNDS[kind]} {_number(next(iter(ctx.values())))}, got {sent_value(value)}"
    if kind in TYPE_WORDS:
        return f"expected {TYPE_WORDS[kind]}, got {sent_value(value)}"
    if kind in ("literal_error", "enum"):
        return f"expected {ctx.get('expected')}, got {sent_value(value)}"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')!r}, got {sent_value(value)}"
    if kind == "missing":
        return "a required field, not sent"
    if kind == "finite_number":  # NaN or Infinity, which Python's JSON parser takes
        return f"must be a finite number, got {sent_value(value)}"
    return str(error.get("msg"))


def at_key(error: dict) -> bool:
    """Whether the error is about a dict's key (pydantic ends its location with ``[key]``)."""
    return tuple(error.get("loc", ()))[-1:] == ("[key]",)


_BOUNDS = {"greater_than_equal": "at least", "greater_than": "must be greater than",
           "less_than_equal": "at most", "less_than": "must be less than"}
TYPE_WORDS = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
          "bool_type": "a boolean", "bool_parsing": "a boolean", "list_type": "a list",
          "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object"}


def _count(n: int, noun: str) -> str:
    """``1 item``, ``16 items``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _number(x: object) -> object:
    """A bound as the request would write it: ``0``, not pydantic's ``0.0``."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def sent_value(value: object) -> str:
    """The sent value in JSON's words: a number or boolean as written, short strings quoted,
    else its JSON type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):  # as JSON text writes them
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, int | float):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def error_code(error: dict) -> str:
    """OpenAI's error code for one pydantic error, by the field's type (not the value's:
    ``"temperature": 5`` is a decimal above its maximum):

    - ``missing_required_parameter``; ``unknown_parameter`` for a key that an object
      declaring its keys does not take (``stream_options.foo``); ``invalid_type`` for a
      value of the wrong JSON type, a string field's enumerated value included
      (``"role": 5``);
    - ``integer_below_min_value`` / ``integer_above_max_value`` for an integer field out of
      range, ``decimal_below_min_value`` / ``decimal_above_max_value`` for a number field
      (pydantic reports a number field's bound as a float, an integer field's as an int);
    - ``string_below_min_length`` / ``string_above_max_length`` for a string's length,
      ``empty_array`` / ``array_below_min_length`` / ``array_above_max_length`` for a list's
      (OpenAI's spellings; ``empty_array`` for ``"content": []`` too);
    - else ``invalid_value`` (a value of the right type the field does not take).
    """
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind.endswith(("_parsing", "_type")) or _wrong_literal_type(kind, error):
        return "invalid_type"
    if kind.startswith(("greater_than", "less_than")):
        bound = next(iter(ctx.values()), None)
        number = "decimal" if isinstance(bound, float) else "integer"
        return f"{number}_{'below_min' if kind.startswith('greater') else 'above_max'}_value"
    if kind in ("string_too_short", "string_too_long"):
        return "string_below_min_length" if kind.endswith("short") else \
            "string_above_max_length"
    if kind == "empty_content":  # ChatMessage's own check of an empty list of parts
        return "empty_array"
    if kind in ("too_short", "too_long"):
        if kind == "too_long":
            return "array_above_max_length"
        return "empty_array" if ctx.get("actual_length") == 0 else "array_below_min_length"
    return "invalid_value"


def _wrong_literal_type(kind: str, error: dict) -> bool:
    """A value outside an enumeration of strings that is not a string at all."""
    if kind not in ("literal_error", "enum"):
        return False
    expected = str((error.get("ctx") or {}).get("expected", ""))
    return not isinstance(error.get("input"), str) and expected.startswith("'")
