"""``qwen3_coder``: Qwen3-Coder's XML calls, each in its own block::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between the tags less one newline at each end, typed by the tool's JSON
schema (``schema_value``): a string stays text, integers / numbers / booleans / null are
read, objects and arrays are read as JSON (else as a Python literal); text that does not
read as its type stays a string. Text before the first ``<tool_call>`` is content; text
between and after the blocks is dropped (as vLLM's parser drops it). Streaming sends ``{`` once the function's name is
read, then each parameter as its closing tag arrives, then ``}``: the pieces join to the
whole reply's arguments. A call to a function the request did not offer ends the reading
(with no call read, the whole reply is content).

Qwen3-Coder often leaves out the opening ``<tool_call>`` (writing ``<function=...>`` ...
``</function>``, often then an orphan ``</tool_call>``): a bare ``<function=NAME>`` is a
block too when NAME is a function the request offered and a ``<parameter=`` or
``</function>`` follows it (vLLM's parsers read bare blocks as well); other text with
``<function=`` in it (prose about the syntax) stays content.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    TaggedBlocksToolParser,
    arguments_items,
    calls_or_content,
    held_back,
    is_plain_name,
    json_member,
    read_blocks,
    schema_types,
)


class Qwen3CoderToolParser(TaggedBlocksToolParser):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    CALL_EXAMPLE = "\n<function=name>\n<parameter=arg>\nvalue\n</parameter>\n</function>\n"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = self._next_block(text, 0)
        if first < 0:  # no block (yet): while streaming a possible start of one waits
            hold = max(held_back(text, m) for m in (self.START, self.FUNCTION))
            return ParsedOutput(text if final else text[:len(text) - hold].rstrip())
        out = ParsedOutput(text[:first].rstrip())
        read_blocks(out, text, first, lambda pos: self._read_block(text, pos),
                    lambda end: self._next_block(text, end))
        return calls_or_content(out, text, final)

    def _next_block(self, text: str, i: int) -> int:
        """Where the first block at or after ``text[i]`` starts: a ``<tool_call>``, or an
        earlier bare ``<function=`` that is (or may still become) a call; -1: none."""
        tag = text.find(self.START, i)
        k = text.find(self.FUNCTION, i)
        while 0 <= k and (tag < 0 or k < tag):
            if self._bare_call(text, k) is not False:
                return k
            k = text.find(self.FUNCTION, k + 1)
        return tag

    def _bare_call(self, text: str, k: int) -> bool | None:
        """Whether the ``<function=`` at ``text[k]`` (no ``<tool_call>`` before it) opens a
        call: a function the request offered, then a ``<parameter=`` or ``</function>``;
        None while the text so far may still become one."""
        head = text[k + len(self.FUNCTION):]
        close = head.find(">")
        name = (head if close < 0 else head[:close]).strip()
        if name and not is_plain_name(name):
            return False
        if close < 0:  # the name is still coming
            return None if self.schemas is None or any(
                f.startswith(name) for f in self.schemas) else False
        if not self.knows(name):
            return False
        rest = head[close + 1:].lstrip()
        if rest.startswith((self.PARAM, self.FUNCTION_END)):
            return True
        return None if self.PARAM.startswith(rest) or self.FUNCTION_END.startswith(rest) \
            else False

    def _read_block(self, text: str, pos: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the block at ``text[pos]``, a ``<tool_call>`` or a bare
        ``<function=`` (read once it surely is a call), and the block's end."""
        if text.startswith(self.START, pos):
            return self._read_call(text, pos + len(self.START))
        if not self._bare_call(text, pos):
            return None, None
        return self._read_call(text, pos)

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call whose ``<function=`` is at or after ``text[i]`` (None until its name is
        read, or if it never is) and the end of its block (None while it is open)."""
        i = skip_ws(text, i)
        close = text.find(">", i)
        if not text.startswith(self.FUNCTION, i) or close < 0:
            return None, None
        name = text[i + len(self.FUNCTION):close].strip()
        if not is_plain_name(name) or not self.knows(name):
            return None, None
        properties = self.parameter_schemas(name)
        pieces, j, complete = [], close + 1, False
        while True:
            j = skip_ws(text, j)
            if text.startswith(self.FUNCTION_END, j):
                j, complete = j + len(self.FUNCTION_END), True
                break
            read = self._read_parameter(text, j) if text.startswith(self.PARAM, j) else None
            if read is None:
                break
            key, raw, j = read
            pieces.append(json_member(key, schema_value(raw, properties.get(key))))
        arguments = "{" + ", ".join(pieces) + ("}" if complete else "")
        if not complete:
            return ParsedCall(name, arguments), None
        after = skip_ws(text, j)
        return ParsedCall(name, arguments, True), \
            after + len(self.END) if text.startswith(self.END, after) else j

    def _read_parameter(self, text: str, j: int) -> tuple[str, str, int] | None:
        """(name, value text, index after it) of the ``<parameter=`` at ``text[j]``, None
        until it is closed: by ``</parameter>``, or, if the model left that out, by the next
        ``<parameter=`` or ``</function>``."""
        close = text.find(">", j)
        if close < 0:
            return None
        ends = [(k, len(tag) if tag == self.PARAM_END else 0)
                for tag in (self.PARAM_END, self.PARAM, self.FUNCTION_END)
                if (k := text.find(tag, close + 1)) >= 0]
        if not ends:
            return None
        k, skip = min(ends)
        raw = text[close + 1:k]
        raw = raw.removeprefix("\n")
        raw = raw.removesuffix("\n")
        return text[j + len(self.PARAM):close].strip(), raw, k + skip

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Each call as its XML block; a string value as its text, others as JSON."""
        return "\n".join(_call_xml(c["function"], self.START, self.END) for c in calls)


class Qwen3XMLToolParser(Qwen3CoderToolParser):
    """vLLM's other parser of the same format (``qwen3_xml``)."""

    name = "qwen3_xml"


def _call_xml(function: dict[str, Any], start: str, end: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                     for k, v in arguments_items(function))
    return f"{start}\n<function={function['name']}>\n{params}</function>\n{end}"


def _number(s: str) -> int | float:
    try:
        return int(s)
    except ValueError:
        value = float(s)
    if not math.isfinite(value):
        raise ValueError(s)
    return value


def _integer(s: str) -> int:
    value = _number(s)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(s)
    return int(value)


def _container(kind: type) -> Any:
    def read(s: str) -> Any:
        """``s`` as a JSON (or Python literal) value of type ``kind``.

        Raises:
            TypeError: for a value of another type; ValueError / SyntaxError for text that
                is neither JSON nor a Python literal.
        """
        try:
            value = json.loads(s)
        except json.JSONDecodeError:
            value = ast.literal_eval(s)  # a Python literal (single quotes, True)
        if not isinstance(value, kind):
            raise TypeError(s)
        return value
    return read


_READERS = {
    "integer": _integer,
    "number": _number,
    "boolean": lambda s: {"true": True, "false": False}[s.lower()],
    "null": lambda s: {"null": None, "none": None}[s.lower()],
    "object": _container(dict),
    "array": _container((list, tuple)),
}


def schema_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """The value of a parameter's text ``raw`` as its JSON ``schema`` types it: the first of
    its non-string types the stripped text reads as, else the text itself (a string, or a
    parameter without a type / not in the schema)."""
    for kind in schema_types(schema):
        reader = _READERS.get(kind)
        if reader is None:
            continue
        try:
            value = reader(raw.strip())
            json.dumps(value, allow_nan=False)
            return list(value) if isinstance(value, tuple) else value
        except (ValueError, KeyError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    return raw
