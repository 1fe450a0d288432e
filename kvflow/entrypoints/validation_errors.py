"""A request body the schema refuses (pydantic's RequestValidationError) as an OpenAI 400:
the first offending field as ``param`` and OpenAI's code for what is wrong with it."""

from __future__ import annotations

import math

from fastapi.exceptions import RequestValidationError

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import RequestModel


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 naming the first offending field (or the JSON syntax error), with a message
    that says the field's limit and what was sent (see :func:`_in_plain_words`)."""
    first = _reported(exc.errors())
    if first.get("type") == "invalid_unicode":
        ctx = first.get("ctx", {})
        return OpenAIError(f"{ctx.get('param')}: {ctx.get('why')}", param=ctx.get("param"),
                           code="invalid_unicode")
    if first.get("type") == "request_limit":  # a body too large to validate (protocol.chat)
        ctx = first.get("ctx", {})
        return OpenAIError(f"{ctx.get('param')}: {ctx.get('why')}", param=ctx.get("param"),
                           code=ctx.get("code"))
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the body is not valid JSON: {first.get('ctx', {}).get('error')}",
                           code="invalid_json")
    loc = _field_path(first.get("loc", ()))
    if first.get("type") == "part_key":  # a content part's key of another part type
        param = ".".join([*loc, first["ctx"]["key"]])
        return OpenAIError(f"Unrecognized request argument supplied: {param} (a "
                           f"{first['ctx']['kind']!r} content part carries "
                           f"{first['ctx']['kind']} only)", param=param,
                           code="unknown_parameter")
    if not loc and first.get("type") == "missing":
        return OpenAIError("the request body is empty: expected a JSON object",
                           code="invalid_json")
    if not loc and first.get("type") in _TYPES:  # a JSON array, string or number
        return OpenAIError(f"the request body must be a JSON object, got "
                           f"{_sent(first.get('input'))}", code="invalid_json")
    param = ".".join(loc) or None
    # a dict key's error names the dict (its param still ends in the key)
    where = ".".join(loc[:-1]) if _at_key(first) and len(loc) > 1 else param
    message = f"{where}: {_in_plain_words(first)}" if param else str(first.get("msg", exc))
    if first.get("type") == "extra_forbidden":  # OpenAI's words for it
        message = f"Unrecognized request argument supplied: {param}"
    alternatives = _union_members(exc.errors(), first)
    if param and len(alternatives) > 1:  # fits no member: say what the field takes
        message = f"{param}: expected {', '.join(alternatives[:-1])} or {alternatives[-1]}"
    return OpenAIError(message, param=param, code=_error_code(first))


def _in_plain_words(error: dict) -> str:
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
        of = " per key" if _at_key(error) else ""
        return f"{bound} {_count(limit, 'character')}{of}, got {len(str(value))}"
    if kind in _BOUNDS:
        return f"{_BOUNDS[kind]} {_number(next(iter(ctx.values())))}, got {_sent(value)}"
    if kind in _TYPES:
        return f"expected {_TYPES[kind]}, got {_sent(value)}"
    if kind in ("literal_error", "enum"):
        return f"expected {ctx.get('expected')}, got {_sent(value)}"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')!r}, got {_sent(value)}"
    if kind == "missing":
        return "a required field, not sent"
    if kind == "finite_number":  # NaN or Infinity, which Python's JSON parser takes
        return f"must be a finite number, got {_sent(value)}"
    return str(error.get("msg"))


def _at_key(error: dict) -> bool:
    """Whether the error is about a dict's key (pydantic ends its location with ``[key]``)."""
    return tuple(error.get("loc", ()))[-1:] == ("[key]",)


_BOUNDS = {"greater_than_equal": "at least", "greater_than": "must be greater than",
           "less_than_equal": "at most", "less_than": "must be less than"}
_TYPES = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
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


def _sent(value: object) -> str:
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


def _union_members(errors: list[dict], first: dict) -> list[str]:
    """What a union field takes, in words (``a string``, ``a list of integers``), when
    ``first`` is the first of its members' errors and no single member got past its own
    type (``"prompt": [5, "a"]``: neither token ids nor strings); else []."""
    loc = tuple(first.get("loc", ()))
    k = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
    if k is None or _reported(errors) is not first or _branch_count(errors, loc[:k]) == 1:
        return []
    tags = []
    for e in errors:
        where = tuple(e.get("loc", ()))
        if where[:k] == loc[:k] and len(where) > k and where[k] not in tags:
            tags.append(where[k])
    return [_in_words(t) for t in tags if t != "none"]


def _branch_count(errors: list[dict], prefix: tuple) -> int:
    """How many union members under ``prefix`` got past their own type."""
    deeper = {_branch(e.get("loc", ())) for e in errors
              if tuple(e.get("loc", ()))[:len(prefix)] == prefix}
    return len(deeper - {None})


_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}


def _in_words(tag: str) -> str:
    """A union-member tag in words: ``list[list[int]]`` -> ``a list of lists of integers``."""
    if tag in _WORDS:
        return _WORDS[tag]
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _in_words(tag[5:-1])
        noun = inner.split(" ", 1)[1] if inner.startswith(("a ", "an ")) else inner
        return "a list of " + {"list": "lists"}.get(noun.split(" ")[0], noun.split(" ")[0] +
                                                    "s") + noun[len(noun.split(" ")[0]):]
    if tag.startswith("dict["):
        return "an object"
    if tag.startswith("literal["):
        return "one of " + tag[8:-1].replace(",", ", ")
    return f"an object ({tag})"


def _reported(errors: list[dict]) -> dict:
    """The error to report. A value that fits no member of a union gets one error per member
    (``content: [{"type": "text", "text": 5}]``: "not a string" from ``str``, "text: not a
    string" from ``list[ContentPart]``); when exactly one member got past its own type (its
    errors lie deeper in the value), its first error says what is wrong; otherwise the first
    error."""
    if not errors:
        return {}
    deeper = [(_branch(e.get("loc", ())), e) for e in errors]
    deeper = [(branch, e) for branch, e in deeper if branch is not None]
    if len({branch for branch, _ in deeper}) == 1:
        return deeper[0][1]
    return errors[0]


def _branch(loc: tuple) -> tuple | None:
    """The location up to a union-member tag followed by more of the value (the member
    whose own type the value has), or None."""
    for k, part in enumerate(loc):
        if _is_tag(part) and k + 1 < len(loc):
            return tuple(loc[:k + 1])
    return None


def _error_code(error: dict) -> str:
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


# pydantic's union-member tags in error locations (not request fields)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _is_tag(part: object) -> bool:
    """Whether a location part is a union-member tag: a type's (``str``, ``list[int]``) or a
    request model's class name (``NamedToolChoice`` of ``tool_choice``)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part
                                      or part in _model_names(RequestModel))


def _model_names(cls: type) -> set[str]:
    """The class names of ``cls``'s subclasses, at every depth."""
    names: set[str] = set()
    for sub in cls.__subclasses__():
        names |= {sub.__name__} | _model_names(sub)
    return names


def _field_path(loc: tuple) -> list[str]:
    """The request-field part of a pydantic error location: without the leading "body" and the
    union-member tags pydantic inserts ("str", "list[int]", "function-after[...]"), so
    ``stop: 5`` reports param "stop", not "stop.str", and a bad content part
    "messages.0.content.1.text"."""
    return [str(part) for part in (loc[1:] if loc[:1] == ("body",) else loc)
            if not _is_tag(part)]
