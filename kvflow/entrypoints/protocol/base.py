"""The base of kvflow's OpenAI API models: the base classes, the error body, the request body
that finds lone surrogates and unknown fields, and small shared validators."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvflow.utils.int_limits import INT32_MAX, INT64_MAX, INT64_MIN  # noqa: F401 (re-exports)
from kvflow.utils.text_checks import find_lone_surrogate


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A part of a request body, validated strictly (pydantic's strict mode), as OpenAI
    validates: an integer field takes only a JSON integer (not ``"8"``, ``8.0`` or ``true``),
    a number field a JSON number (an integer is a number: ``"temperature": 1`` is valid), a
    boolean field only ``true`` / ``false`` (not ``"true"`` or ``1``). A refused value is a 400
    with code ``invalid_type`` naming the field.

    A nested object (a content part, ``response_format.json_schema``, a tool's ``function``,
    ``tool_choice``, ``stream_options``, ...) takes only the keys it declares: another key is a
    400 with code ``unknown_parameter`` whose ``param`` is the key's path
    (``response_format.json_schema.strct``), as OpenAI refuses it, so that a misspelled key
    is never silently dropped. Top-level bodies (``RequestBody``) keep their unknown fields
    aside instead, for the server to refuse (or, under ``--ignore-unknown-fields``, ignore
    and log, as vLLM does: ``entrypoints/unknown_fields.py``)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class OmitNoneModel(OpenAIBaseModel):
    """A response model whose ``OMIT_IF_NONE`` fields are left out of the JSON when None
    (extensions nobody asked for, a delta's absent role)."""

    OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.OMIT_IF_NONE:
            if data.get(name, 0) is None:
                del data[name]
        return data


# ---- errors --------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


def request_limit(param: str, why: str) -> PydanticCustomError:
    """The error for a body over one of kvflow's size limits, raised before the body is
    validated (the schema runs on the server's event loop): the server answers it with a
    400 at ``param`` (code ``array_above_max_length``) saying ``why``
    (``validation_errors``)."""
    return PydanticCustomError("request_limit", "{why}",
                               {"param": param, "code": "array_above_max_length", "why": why})


def unknown_and_missing(unknown: dict[str, Any], missing: str) -> PydanticCustomError:
    """The error for a body that misses a required field (``missing``) and sends fields the
    model does not declare (``unknown``: name -> value sent), likely that field misspelled
    (``{"inptu": "x"}``): the server answers it as it answers the unknown fields (a 400
    naming them, or under ``--ignore-unknown-fields`` the missing field), saying both
    (``validation_errors``)."""
    return PydanticCustomError("unknown_and_missing", "{missing}: a required field, not sent",
                               {"unknown": unknown, "missing": missing})


# ---- shared request fields -----------------------------------------------------------------------
class RequestBody(RequestModel):
    """A top-level request body: all its text is checked for lone surrogates before
    validation (``invalid_unicode`` error with ``ctx.param``), a field sent as null takes its
    default (``"n": null`` is ``n`` unset, 1; as OpenAI's nullable fields and vLLM read it),
    and the names of fields it does not declare are kept in ``unknown_fields`` (for the
    handler to refuse or log: ``entrypoints/unknown_fields.UnknownFields``)."""

    model_config = ConfigDict(extra="ignore")

    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())
    _unknown_values: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _check_body(cls, data: Any, handler: Any) -> Any:
        found = find_lone_surrogate(data) if isinstance(data, dict) else None
        if found is not None:
            raise PydanticCustomError("invalid_unicode", "{param} {why}",
                                      {"param": found[0], "why": found[1]})
        if isinstance(data, dict):  # null means unset, as OpenAI's nullable fields read it
            data = {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required() or cls.model_fields[k].default is None}
        unknown = cls._undeclared(data)
        try:
            model = handler(data)
        except ValidationError as e:
            missing = [err["loc"][0] for err in e.errors()
                       if err["type"] == "missing" and len(err["loc"]) == 1]
            if unknown and missing:  # the unknown field is likely the one misspelled
                raise unknown_and_missing(unknown, str(missing[0])) from None
            raise
        if isinstance(data, dict):  # not a model instance validated again: it keeps its own
            model._unknown_fields = tuple(unknown)
            model._unknown_values = unknown
        return model

    @classmethod
    def _undeclared(cls, data: Any) -> dict[str, Any]:
        """The top-level fields of body ``data`` that ``cls`` does not declare (by name or
        alias), sorted by name, with the values sent; {} for a body that is no object."""
        if not isinstance(data, dict):
            return {}
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: data[k] for k in sorted(data) if k not in known}

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """Top-level fields of the body that this model does not declare, sorted (not
        validated; the server refuses or logs them)."""
        return self._unknown_fields

    @property
    def unknown_values(self) -> dict[str, Any]:
        """The values sent in ``unknown_fields``, by name (as parsed from the JSON)."""
        return self._unknown_values


def now() -> int:
    """The current Unix time in whole seconds (a response's ``created``)."""
    return int(time.time())
