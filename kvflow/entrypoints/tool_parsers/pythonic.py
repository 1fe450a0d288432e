"""``pythonic``: the reply is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), get_time()]`` (Llama 3.2 and Llama 4's documented
tool format; Llama 4 may wrap it in ``<|python_start|>`` ... ``<|python_end|>``).

Each call is read with Python's ``ast`` and each argument with ``ast.literal_eval``: literals
only (strings, numbers, True/False/None, lists, tuples, dicts of them), nothing evaluated.
The list is read a call at a time, in order: a call is complete once its closing parenthesis
arrives (the stream sends it then, its arguments whole), and reading ends at the first item
that is not such a call (a positional or non-literal argument, a function the request did not
offer, anything else); what follows it is dropped. Text after the list's ``]`` is content. A
reply whose first item is not a call is content, all of it: streaming holds a reply back
while it may still become a call list (``[`` then a name and ``(``); any other reply streams
as content at once.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvflow.chat.messages import arguments_object
from kvflow.entrypoints.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser

# every prefix of "[ name (" followed by anything: what a call list may still become
_OPENING = re.compile(r"(?:\[\s*(?:[A-Za-z_]\w*\s*(?:\(.*)?)?)?\Z", re.DOTALL)
_PARSE_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)
_CALL_HEAD = re.compile(r"[A-Za-z_]\w*\s*\(")
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _closing_paren(text: str, i: int) -> int | None:
    """Index of the bracket closing the one at ``text[i]``, skipping Python string literals
    (single, double, triple quoted; backslash escapes); None if it has not arrived, or if
    the brackets do not match. Decides only from ``text`` up to that bracket, so a prefix of
    the text finds the same one."""
    stack, j = [], i
    while j < len(text):
        c = text[j]
        if c in "'\"":
            j = _string_end(text, j)
            if j is None:
                return None
            continue
        if c in _BRACKETS:
            stack.append(_BRACKETS[c])
        elif c in ")]}":
            if c != stack.pop():
                return None
            if not stack:
                return j
        j += 1
    return None


def _string_end(text: str, j: int) -> int | None:
    """Index after the string literal opening at ``text[j]``; None until it is closed."""
    if j + 2 >= len(text):
        return None  # whether it opens a triple quote is not known yet
    quote = text[j] * 3 if text[j + 1] == text[j + 2] == text[j] else text[j]
    k = j + len(quote)
    while k < len(text):
        if text[k] == "\\":
            k += 2
        elif text.startswith(quote, k):
            return k + len(quote)
        elif len(quote) == 1 and text[k] == "\n":
            return k + 1  # an unterminated string: ast will refuse the call
        else:
            k += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    TAGS = ("<|python_start|>", "<|python_tag|>")
    END_TAG = "<|python_end|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        for tag in self.TAGS:
            if not final and tag.startswith(body.rstrip()):
                return ParsedOutput("")  # maybe the tag is coming
            if body.startswith(tag):
                body = body[len(tag):].lstrip()
                break
        calls, after = self._read_calls(body, final)
        if calls:
            return ParsedOutput(self._content_after(after, final), calls)
        if final or not _OPENING.match(body.rstrip()):
            return ParsedOutput(text)
        return ParsedOutput("")  # may still become a call list

    def _read_calls(self, body: str, final: bool) -> tuple[list[ParsedCall], str | None]:
        """The complete calls at the start of the list ``body`` and the text after its ``]``
        (None while the list is open, or if reading ended before it)."""
        calls: list[ParsedCall] = []
        if not body.startswith("["):
            return calls, None
        i = _skip_ws(body, 1)
        while True:
            head = _CALL_HEAD.match(body, i)
            close = _closing_paren(body, head.end() - 1) if head else None
            call = self._read_call(body[i:close + 1]) if close is not None else None
            if call is None:
                return calls, None
            calls.append(call)
            i = _skip_ws(body, close + 1)
            if body.startswith("]", i):
                return calls, body[i + 1:]
            if not body.startswith(",", i):
                return calls, None
            i = _skip_ws(body, i + 1)

    def _read_call(self, expr: str) -> ParsedCall | None:
        """The call ``expr`` (``name(key=literal, ...)``), or None if it is not one (see the
        module)."""
        try:
            node = ast.parse(expr, mode="eval").body
        except _PARSE_ERRORS:
            return None
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and self.knows(node.func.id)
                and all(kw.arg is not None for kw in node.keywords)):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except _PARSE_ERRORS:  # not a literal; a set, bytes, complex, inf
            return None
        return ParsedCall(node.func.id, text, True)

    def _content_after(self, after: str | None, final: bool) -> str:
        """The text after the list, less Llama 4's ``<|python_end|>`` (a possible start of it
        waits while streaming), stripped."""
        after = (after or "").strip()
        if after.startswith(self.END_TAG):
            return after[len(self.END_TAG):].strip()
        return "" if not final and self.END_TAG.startswith(after) else after

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        return ("You can call the functions below. To call them, reply with only a Python "
                "list of calls with keyword arguments, [name1(arg1=value1, arg2=value2), "
                f"name2(...)], and no other text.\nFunctions (JSON):\n{listing}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Each call as ``name(key=repr(value), ...)``; arguments that are not a JSON object
        are left out (they have no keyword form)."""
        return "[" + ", ".join(_call_expr(c["function"]) for c in calls) + "]"


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's name for the same format on Llama 4 (``<|python_start|>`` ... optional)."""

    name = "llama4_pythonic"


def _call_expr(function: dict[str, Any]) -> str:
    arguments = arguments_object(function.get("arguments") or "{}")
    return f"{function['name']}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
