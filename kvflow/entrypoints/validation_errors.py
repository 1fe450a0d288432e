"""A request body the schema refuses (pydantic's RequestValidationError) as an OpenAI 400:
the first offending field as ``param`` and OpenAI's code for what is wrong with it."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import RequestModel
from kvflow.entrypoints.unknown_fields import UNSUPPORTED, UnknownFields
from kvflow.utils.validation_words import TYPE_WORDS, error_code, field_message, sent_value


def validation_error(exc: RequestValidationError, unknown: UnknownFields | None = None,
                     endpoint: str = "") -> OpenAIError:
    """A 400 naming the first offending field (or the JSON syntax error), with a message
    that says the field's limit and what was sent (see ``kvflow.utils.validation_words``). A body
    that misses a required field and sends undeclared ones (``{"inptu": "x"}``) is answered
    as ``unknown`` (the server's ``UnknownFields``; default: refuse them) answers those
    fields, sent to ``endpoint``, and names the missing field too."""
    first = _reported(exc.errors())
    if first.get("type") == "unknown_and_missing":
        return _unknown_and_missing(first["ctx"], unknown or UnknownFields(), endpoint)
    if first.get("type") in ("invalid_unicode", "request_limit"):  # before validation
        ctx = first.get("ctx", {})
        param = _sent_at(str(ctx.get("param")), exc.body)
        return OpenAIError(f"{param}: {ctx.get('why')}", param=param,
                           code=ctx.get("code", "invalid_unicode"))
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the body is not valid JSON: {_json_syntax_error(first, exc.body)}",
                           code="invalid_json")
    loc = _field_path(first.get("loc", ()))
    if loc[:1] == ["messages"] and len(loc) > 1 and _chat_input(exc.body):
        loc[0] = "input"  # as _sent_at
    if first.get("type") == "part_key":  # a content part's key of another part type
        param = ".".join([*loc, first["ctx"]["key"]])
        return OpenAIError(f"Unrecognized request argument supplied: {param} (a "
                           f"{first['ctx']['kind']!r} content part carries "
                           f"{first['ctx']['kind']} only)", param=param,
                           code="unknown_parameter")
    if not loc and first.get("type") == "missing":
        return OpenAIError("the request body is empty: expected a JSON object",
                           code="invalid_json")
    if not loc and first.get("type") in TYPE_WORDS:  # a JSON array, string or number
        return OpenAIError(f"the request body must be a JSON object, got "
                           f"{sent_value(first.get('input'))}", code="invalid_json")
    param = ".".join(loc) or None
    # a dict key's error names the dict (its param still ends in the key)
    message = field_message(loc, first) if param else str(first.get("msg", exc))
    alternatives = _union_members(exc.errors(), first)
    if param and len(alternatives) > 1:  # fits no member: say what the field takes
        message = f"{param}: expected {', '.join(alternatives[:-1])} or {alternatives[-1]}"
    return OpenAIError(message, param=param, code=error_code(first))


def _sent_at(param: str, body: Any) -> str:
    """``param`` as the client sent it: a ``messages.<...>`` path is ``input.<...>`` in a
    body without ``messages`` but with ``input`` (/v1/embeddings' chat messages sent in
    ``input``, which ``EmbeddingRequest`` validates as ``messages``)."""
    if param.startswith("messages.") and _chat_input(body):
        return "input" + param[len("messages"):]
    return param


def _chat_input(body: Any) -> bool:
    """Whether ``body`` has ``input`` and no ``messages`` (an error about its ``messages``
    is then about chat messages sent in ``input``)."""
    return isinstance(body, dict) and "messages" not in body and "input" in body


def _json_syntax_error(error: dict, doc: Any) -> str:
    """FastAPI's ``json_invalid`` error (its ``loc`` ends with the character offset, its
    ``ctx`` holds json's reason) in json's own words with the place, as ``run-batch`` names a
    line's: ``Expecting value: line 2 column 16 (char 31)`` (``doc``: the body's text, the
    error's ``body``); the reason alone when either is missing."""
    why = error.get("ctx", {}).get("error")
    loc = error.get("loc", ())
    pos = loc[-1] if loc else None
    if not isinstance(doc, str) or not isinstance(pos, int) or not 0 <= pos <= len(doc):
        return str(why)
    return str(json.JSONDecodeError(str(why), doc, pos))


def _unknown_and_missing(ctx: dict, unknown: UnknownFields, endpoint: str) -> OpenAIError:
    """The refusal of the undeclared fields ``ctx["unknown"]`` (as ``unknown`` refuses
    them) followed by "``ctx["missing"]``: a required field, not sent"; where ``unknown``
    ignores them (``--ignore-unknown-fields``: logged), the missing field's 400, naming the
    fields ignored."""
    missing = f"{ctx['missing']}: a required field, not sent"
    try:
        unknown.check_values(ctx["unknown"], endpoint)
    except OpenAIError as e:
        return OpenAIError(f"{e}; and {missing}", param=e.param, code=e.code)
    ignored = [name for name in ctx["unknown"] if name not in UNSUPPORTED]  # else harmless
    if ignored:
        missing += f" (the body's fields kvflow does not know, ignored: {', '.join(ignored)})"
    return OpenAIError(missing, param=ctx["missing"], code="missing_required_parameter")


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
    """A union-member tag in words: ``list[list[int]]`` -> ``a list of lists of integers``,
    ``list[union[str,int]]`` -> ``a list of strings or integers``."""
    if tag in _WORDS:
        return _WORDS[tag]
    if tag.startswith("union[") and tag.endswith("]"):
        return _joined([_in_words(member) for member in _members(tag[6:-1])])
    if tag.startswith("list[") and tag.endswith("]"):
        inner = tag[5:-1]
        members = _members(inner[6:-1]) if inner.startswith("union[") else [inner]
        return "a list of " + _joined([_plural(_in_words(member)) for member in members])
    if tag.startswith("dict["):
        return "an object"
    if tag.startswith("literal["):
        return "one of " + tag[8:-1].replace(",", ", ")
    return f"an object ({tag})"


def _plural(words: str) -> str:
    """``a list of integers`` -> ``lists of integers``, ``an integer`` -> ``integers``."""
    noun = words.split(" ", 1)[1] if words.startswith(("a ", "an ")) else words
    head = noun.split(" ")[0]
    return head + "s" + noun[len(head):]


def _members(inner: str) -> list[str]:
    """A union tag's members (``str,list[int]`` -> ``["str", "list[int]"]``), split at the
    commas outside brackets."""
    members, depth, start = [], 0, 0
    for i, char in enumerate(inner):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            members.append(inner[start:i].strip())
            start = i + 1
    return [*members, inner[start:].strip()]


def _joined(words: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


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
