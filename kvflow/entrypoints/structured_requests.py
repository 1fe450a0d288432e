"""OpenAI request fields -> structured-output constraints: ``response_format``, the
``structured_outputs`` extra body field, and ``tools`` + ``tool_choice`` (which also pick the
parser that reads tool calls back out of the text)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from kvflow.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
    ResponseFormat,
    SamplingRequest,
    StructuredOutputsField,
    TokenizeRequest,
)
from kvflow.entrypoints.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    make_tool_parser,
)
from kvflow.structured import StructuredOutputsParams, validate
from kvflow.structured.structural_tag import StructuralTagError, check_legacy

_ANY_OBJECT = {"type": "object"}
# A function without ``parameters`` takes none (OpenAI: omitting parameters defines a function
# with an empty parameter list): its forced call's arguments can only be {}.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# Tools whose schemas are checked on the event loop; more go to a worker thread (each schema's
# check against its meta-schema takes ~0.5 ms: 2,048 tools held the loop ~1 s).
TOOLS_INLINE = 8


class RequestFieldError(ValueError):
    """A bad request field; ``param`` names it (becomes the 400's ``param``), ``code`` the
    OpenAI error code (``invalid_value``)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


# how StructuredOutputsParams names itself and its fields in its errors
_INTERNAL_NAME = re.compile(r"SamplingParams\.structured_outputs(\.\w+)?")
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def request_constraint(req: SamplingRequest,
                       tool_grammar: StructuredOutputsParams | None = None
                       ) -> StructuredOutputsParams | None:
    """The constraint from ``response_format``, ``structured_outputs``, one of vLLM's older
    ``guided_*`` fields, or ``tool_grammar`` (the grammar of tool_choice ``required`` or a
    named function, see :func:`tool_constraint`): one source only.

    Raises:
        RequestFieldError: for two sources at once, a json_schema format without a schema, a
            field of one format type under another (``json_schema`` under ``json_object``,
            ``triggers`` under ``json_schema``), or a malformed structural tag (naming its
            field: ``response_format.structures.0.begin``).
    """
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None:
        _check_format_fields(fmt)
    sources = _constraint_sources(req) + (["tool_choice"] if tool_grammar is not None else [])
    if len(sources) > 1:
        raise RequestFieldError(f"set only one of {', '.join(sources)}: each constrains the "
                                "output", sources[-1])
    if tool_grammar is not None:
        return tool_grammar
    guided = [(name, getattr(req, name)) for name in _GUIDED_FIELDS
              if getattr(req, name) is not None]
    if guided:
        return _guided_constraint(*guided[0])
    if extra is not None:
        return _structured_outputs_constraint(extra)
    return _format_constraint(fmt)


def _guided_constraint(name: str, value: Any) -> StructuredOutputsParams:
    """vLLM's older ``guided_*`` field ``name`` (``guided_json``, ...) as its constraint.

    Raises:
        RequestFieldError: for a bad value, naming ``name`` (not ``structured_outputs.*``).
    """
    try:
        return StructuredOutputsParams(**{_GUIDED_FIELDS[name]: value})
    except ValueError as e:  # guided_choice, not structured_outputs.choice
        raise RequestFieldError(_INTERNAL_NAME.sub(name, str(e)), name) from None


def _structured_outputs_constraint(extra: StructuredOutputsField) -> StructuredOutputsParams:
    """The request's ``structured_outputs`` object as its constraint.

    Raises:
        RequestFieldError: for a bad field, named as the request names it
            (``structured_outputs.regex``, not SamplingParams').
    """
    fields = extra.model_dump(by_alias=True, exclude_none=True)
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:  # the request's own names, not SamplingParams'
        inner = _INTERNAL_NAME.search(str(e))
        param = "structured_outputs" + (inner.group(1) or "" if inner else "")
        raise RequestFieldError(_INTERNAL_NAME.sub(param, str(e)), param) from None


def _format_constraint(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    """``response_format``'s constraint: None for none or ``text``; a JSON object; a
    structural tag; a JSON schema (``true``: any JSON).

    Raises:
        RequestFieldError: for a json_schema format without a schema or with schema
            ``false``, or a malformed structural tag (naming its field).
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "structural_tag":
        return StructuredOutputsParams(structural_tag=_structural_tag(fmt))
    schema = None if fmt.json_schema is None else fmt.json_schema.json_schema
    if schema is None:
        raise RequestFieldError("response_format of type json_schema needs "
                                "json_schema.schema", "response_format.json_schema.schema")
    if schema is False:
        raise RequestFieldError("response_format.json_schema.schema is false, a schema no "
                                "output matches", "response_format.json_schema.schema")
    return StructuredOutputsParams(json="true" if schema is True else schema)


# response_format's fields of one type only: each is refused under another type (ignored, it
# would loosen or change the constraint the client asked for)
_FORMAT_FIELDS = {"json_schema": "json_schema", "structures": "structural_tag",
                  "triggers": "structural_tag", "format": "structural_tag"}


def _check_format_fields(fmt: ResponseFormat) -> None:
    for name, owner in _FORMAT_FIELDS.items():
        if fmt.type != owner and getattr(fmt, name) is not None:
            raise RequestFieldError(f"response_format.{name} applies to type {owner} only "
                                    f"(the type is {fmt.type!r}, which would ignore it)",
                                    f"response_format.{name}")


def _structural_tag(fmt: ResponseFormat) -> dict[str, Any]:
    """``response_format`` of type structural_tag as the constraint's tag: xgrammar's
    ``format`` spelling as given, or the legacy ``structures`` + ``triggers`` checked here
    (``structural_tag.check_legacy``); whether each schema compiles is checked with the
    constraint.

    Raises:
        RequestFieldError: for both spellings at once or a malformed legacy tag, naming the
            field (``response_format.triggers``, ``response_format.structures.1.begin``).
    """
    if fmt.format is not None:
        if fmt.structures is not None or fmt.triggers is not None:
            raise RequestFieldError("response_format of type structural_tag takes either "
                                    "format (xgrammar's spelling) or structures and triggers, "
                                    "not both", "response_format.format")
        return {"type": "structural_tag", "format": fmt.format}
    tag: dict[str, Any] = {"type": "structural_tag"}
    if fmt.structures is not None:
        tag["structures"] = [s.model_dump(by_alias=True) for s in fmt.structures]
    if fmt.triggers is not None:
        tag["triggers"] = fmt.triggers
    try:
        check_legacy(tag)
    except StructuralTagError as e:
        raise RequestFieldError(f"invalid structural tag: response_format.{e}",
                                f"response_format.{e.path}") from None
    return tag


def _constraint_sources(req: SamplingRequest) -> list[str]:
    """The request fields that set an output constraint, in the order they are read."""
    fmt = req.response_format
    sources = [name for name in _GUIDED_FIELDS if getattr(req, name) is not None]
    sources += ["structured_outputs"] if req.structured_outputs is not None else []
    return sources + (["response_format"] if fmt is not None and fmt.type != "text" else [])


def constraint_param(req: SamplingRequest) -> str | None:
    """The request field a constraint came from, for errors found when it is compiled (None
    when the request sets none): ``guided_*``, ``structured_outputs.<its field>``
    (``structured_outputs.grammar``, ...), ``response_format`` or
    ``response_format.json_schema.schema``."""
    sources = _constraint_sources(req)
    if not sources:
        return None
    if sources[0] == "response_format" and req.response_format.type == "json_schema":
        return "response_format.json_schema.schema"
    if sources[0] == "structured_outputs":
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        return ".".join(["structured_outputs", *list(fields)[:1]])
    return sources[0]


def check_tools(tools: list[ChatTool] | None, compile_schemas: bool = False) -> None:
    """Each tool's function name unique, and its ``parameters`` a valid JSON schema (checked
    against its JSON Schema meta-schema, ``jsonschema``); with ``compile_schemas``
    (tool_choice ``required`` or named, where the grammar enforces the arguments) one the
    grammar backend also compiles (xgrammar refuses a few valid but unusual schemas, which
    tool_choice ``auto`` - the model writes the call unconstrained - still takes).

    Raises:
        RequestFieldError: naming ``tools.N.function.name`` (a name an earlier tool has) or
            ``tools.N.function.parameters`` (an invalid schema, or one that does not
            compile when ``compile_schemas``).
    """
    first: dict[str, int] = {}
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if name in first:
            raise RequestFieldError(f"tools {first[name]} and {i} are both named {name!r}: "
                                    "function names must be unique", f"tools.{i}.function.name")
        first[name] = i
        if tool.function.parameters is None:
            continue
        try:
            _check_schema(tool.function.parameters)
            if compile_schemas:
                validate(StructuredOutputsParams(json=tool.function.parameters))
        except ValueError as e:
            why = str(e).replace("invalid JSON schema in structured_outputs: ", "")
            raise RequestFieldError(f"tools.{i}.function.parameters is not a valid JSON "
                                    f"schema: {why}", f"tools.{i}.function.parameters") \
                from None


async def check_tools_off_loop(tools: list[ChatTool] | None,
                               compile_schemas: bool = False) -> None:
    """:func:`check_tools`, in a worker thread for more than :data:`TOOLS_INLINE` tools
    (the event loop keeps serving meanwhile; the check is pure Python, so it shares the GIL
    with the loop in turns of ``sys.getswitchinterval()``, 5 ms), inline for fewer.

    Raises:
        RequestFieldError: as :func:`check_tools`.
    """
    if len(tools or ()) <= TOOLS_INLINE:
        check_tools(tools, compile_schemas)
    else:
        await asyncio.to_thread(check_tools, tools, compile_schemas)


def _check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError unless ``schema`` is valid under its ``$schema`` draft (default:
    2020-12), with the meta-schema's first complaint, or when it is nested too deep for
    ``jsonschema`` to walk (about 100 ``properties`` levels reach Python's recursion limit:
    that RecursionError had been a 500)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"{e.message}{f' (at {where})' if where else ''}") from None
    except RecursionError:
        raise ValueError("it is nested too deep to be checked (past Python's recursion "
                         "limit)") from None


def tool_choice_mode(req: ChatCompletionRequest | TokenizeRequest) -> str | None:
    """``None`` (no tools, or tool_choice none), ``auto``, ``required`` or ``named``.

    Raises:
        RequestFieldError: for tool_choice without tools, or naming an unknown function.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise RequestFieldError("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise RequestFieldError(f"tool_choice names function {choice.function.name!r}, "
                                    f"which is not among the tools {names}", "tool_choice")
        return "named"
    return choice or "auto"


def tool_constraint(req: ChatCompletionRequest, mode: str | None
                    ) -> StructuredOutputsParams | None:
    """The grammar that enforces ``required`` (a JSON array of one or more calls to the given
    functions) or a named function (its arguments); None otherwise."""
    if mode == "named":
        function = next(t.function for t in req.tools
                        if t.function.name == req.tool_choice.function.name)
        return StructuredOutputsParams(json=arguments_schema(function.parameters))
    if mode != "required":
        return None
    at = "/items/properties/arguments" if len(req.tools) == 1 else \
        "/items/anyOf/{}/properties/arguments"
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             "arguments": relocated_refs(arguments_schema(t.function.parameters),
                                                         at.format(i))},
              "required": ["name", "arguments"]} for i, t in enumerate(req.tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


# keywords whose values are data, not subschemas: a "$ref" key inside them is no reference
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def relocated_refs(schema: Any, pointer: str) -> Any:
    """``schema`` (a function's parameters) as it reads when placed at JSON pointer
    ``pointer`` of a larger schema (tool_choice ``required``'s array of calls): each local
    reference (``#`` or ``#/...``: pydantic's ``#/$defs/Name``) points into it there
    (``#<pointer>/...``), as it did at the root; a copy, the request's tools unchanged.
    Otherwise ``#/$defs/Name`` named the array's root, which has no ``$defs`` (a 400), and
    ``#`` the array itself."""
    if isinstance(schema, list):
        return [relocated_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or
                                                         value.startswith("#/")):
            moved[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = relocated_refs(value, pointer)
    return moved


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema a forced call's ``arguments`` must satisfy: the function's
    ``parameters``; ``{}`` (no arguments at all) when it has none, as OpenAI defines a function
    without ``parameters``; any object for ``parameters: {}``."""
    if parameters is None:
        return _NO_PARAMETERS
    return parameters or _ANY_OBJECT


def tool_parser_for(req: ChatCompletionRequest, mode: str | None,
                    auto_parser: str) -> ToolParser | None:
    """The parser that reads this request's tool calls back (None: content only)."""
    if mode == "named":
        return NamedToolParser(req.tool_choice.function.name)
    if mode == "required":
        return RequiredToolParser()
    if mode == "auto":
        return make_tool_parser(auto_parser, [t.model_dump(exclude_none=True)
                                              for t in req.tools or []])
    return None


def tools_for_template(req: ChatCompletionRequest | TokenizeRequest, mode: str | None,
                       exclude_when_none: bool = False) -> list[dict] | None:
    """The tools as the chat template's ``tools`` argument, for a chat or a /tokenize
    request: None without tools, and under tool_choice ``none`` (``mode`` None) only with
    ``exclude_when_none`` (``--exclude-tools-when-tool-choice-none``); otherwise the model
    still sees them, as with OpenAI and vLLM (it knows the functions, and calls none)."""
    if not req.tools or (mode is None and exclude_when_none):
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]
