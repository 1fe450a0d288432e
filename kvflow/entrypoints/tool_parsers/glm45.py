"""``glm45``: GLM-4.5 / 4.6's calls, the function's name and then key / value pairs::

    Let me check.<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A value is its text as written when the tool's schema types the parameter ``string`` (GLM's
chat template writes a string value verbatim, so its spaces and newlines are the value's, as
vLLM 0.32 keeps them) or gives it no type (not in the schema, ``{}``, tools unknown: vLLM
0.32 keeps such values as text), else its stripped text read as JSON, else as a Python
literal, else its text as written (``glm_value``).
Text before the first ``<tool_call>`` is content; text between and after the blocks is dropped
(as vLLM's parser drops it). Streaming sends ``{`` once the name's line ends, then each
pair as its ``</arg_value>`` arrives, then ``}``. A call to a function the request did not
offer ends the reading (with no call read, the whole reply is content). The tags are special
tokens of GLM's tokenizer: the reply is decoded with them.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    TaggedBlocksToolParser,
    arguments_items,
    is_plain_name,
    json_member,
    schema_types,
)


class Glm45ToolParser(TaggedBlocksToolParser):
    name = "glm45"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"
    KEY, KEY_END = "<arg_key>", "</arg_key>"
    VALUE, VALUE_END = "<arg_value>", "</arg_value>"
    CALL_EXAMPLE = f"name\n{KEY}arg{KEY_END}\n{VALUE}value{VALUE_END}\n"

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call whose name starts at ``text[i]`` (None until the name's line ends, or if
        it names no offered function) and the end of its block (None while it is open)."""
        ends = [k for tag in ("\n", self.KEY, self.END) if (k := text.find(tag, i)) >= 0]
        if not ends:
            return None, None
        name = text[i:min(ends)].strip()
        if not is_plain_name(name) or not self.knows(name):
            return None, None
        properties = self.parameter_schemas(name)
        pieces, j = [], min(ends)
        while True:
            j = skip_ws(text, j)
            if text.startswith(self.END, j):
                arguments = "{" + ", ".join(pieces) + "}"
                return ParsedCall(name, arguments, True), j + len(self.END)
            pair = self._read_pair(text, j)
            if pair is None:
                return ParsedCall(name, "{" + ", ".join(pieces)), None
            key, raw, j = pair
            pieces.append(json_member(key, glm_value(raw, properties.get(key))))

    def _read_pair(self, text: str, j: int) -> tuple[str, str, int] | None:
        """(key, value text, index after it) of the ``<arg_key>`` at ``text[j]``; None until
        its ``</arg_value>`` arrives, or if the pair is malformed."""
        if not text.startswith(self.KEY, j):
            return None
        key_end = text.find(self.KEY_END, j)
        if key_end < 0:
            return None
        v = skip_ws(text, key_end + len(self.KEY_END))
        value_end = text.find(self.VALUE_END, v)
        if not text.startswith(self.VALUE, v) or value_end < 0:
            return None
        return (text[j + len(self.KEY):key_end].strip(), text[v + len(self.VALUE):value_end],
                value_end + len(self.VALUE_END))

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Each call's block; a string value as its text, others as JSON."""
        return "\n".join(
            f"{self.START}{c['function']['name']}\n" + "".join(
                f"{self.KEY}{k}{self.KEY_END}\n{self.VALUE}{v}{self.VALUE_END}\n"
                for k, v in arguments_items(c["function"])) + self.END for c in calls)


def glm_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A GLM parameter's value, as vLLM 0.32's glm45 reads it where it can be told: ``raw``
    as written when ``schema`` gives no type (``{}``, a parameter not in the schema, a
    function without parameters, tools unknown: GLM's template writes a string verbatim and
    anything else as JSON, so ``3`` may be either) or types it ``string`` (``["string",
    "null"]`` too: then ``null`` is None); else the JSON value its stripped text reads as,
    else the Python literal (a JSON-encodable one), else ``raw``."""
    types = set(schema_types(schema))
    if not types or types <= {"string", "null"}:
        return None if "null" in types and raw.lower() == "null" else raw
    text = raw.strip()
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
            return list(value) if isinstance(value, tuple) else value
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    return raw
