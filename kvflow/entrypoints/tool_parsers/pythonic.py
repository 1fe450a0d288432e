"""``pythonic``: the reply is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), get_time()]`` (Llama 3.2 and Llama 4's documented
tool format; Llama 4 may wrap it in ``<|python_start|>`` ... ``<|python_end|>``).

The list is read with Python's ``ast`` and each argument with ``ast.literal_eval``: literals
only (strings, numbers, True/False/None, lists, tuples, dicts of them), nothing evaluated.
All or nothing: a reply that is not exactly such a list (text around it, unbalanced brackets,
a positional or non-literal argument, a function the request did not offer) is content.
Streaming holds a reply back while it may still be a call list (``[`` then a name and ``(``),
and reads the calls once generation has ended; any other reply streams as content at once.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvflow.entrypoints.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser

# every prefix of "[ name (" followed by anything: what a call list may still become
_OPENING = re.compile(r"(?:\[\s*(?:[A-Za-z_]\w*\s*(?:\(.*)?)?)?\Z", re.DOTALL)
_PARSE_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)


class PythonicToolParser(ToolParser):
    name = "pythonic"
    TAGS = ("<|python_start|>", "<|python_tag|>")
    END_TAG = "<|python_end|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.strip()
        for tag in self.TAGS:
            if not final and tag.startswith(body):
                return ParsedOutput("")  # maybe the tag is coming
            if body.startswith(tag):
                body = body[len(tag):].lstrip()
                break
        if not final:
            return ParsedOutput("" if _OPENING.match(body) else text)
        if body.endswith(self.END_TAG):
            body = body[:-len(self.END_TAG)].rstrip()
        calls = self._read_calls(body)
        return ParsedOutput("", calls) if calls else ParsedOutput(text)

    def _read_calls(self, body: str) -> list[ParsedCall] | None:
        """The calls of the list ``body``, or None if it is not one (see the module)."""
        if not (body.startswith("[") and body.endswith("]")):
            return None
        try:
            tree = ast.parse(body, mode="eval")
        except _PARSE_ERRORS:
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and self.knows(node.func.id)
                    and all(kw.arg is not None for kw in node.keywords)):
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            except _PARSE_ERRORS:  # not a literal; a set, bytes, complex, inf
                return None
            calls.append(ParsedCall(node.func.id, text, True))
        return calls

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
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return f"{function['name']}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
