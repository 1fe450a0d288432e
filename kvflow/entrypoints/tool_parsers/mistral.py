"""``mistral``: calls after the ``[TOOL_CALLS]`` control token, in either of Mistral's formats:

- a JSON list, ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (tokenizers before
  v11: Mistral 7B v0.3, Mistral Nemo, Mistral Small 3.1);
- one ``[TOOL_CALLS]name[ARGS]{...}`` per call (tokenizer v11 and later: Mistral Small 3.2,
  Magistral, Devstral), optionally ``name[CALL_ID]id[ARGS]``.

Text before the first ``[TOOL_CALLS]`` is content; text after the calls is dropped (so does
vLLM's parser: its content is the text before the token). A call to
a function the request did not offer, or one that cannot be read, ends the reading; when no
call was read the whole reply is content. ``[TOOL_CALLS]`` is a special token, so the reply is
decoded with special tokens whatever the request's ``skip_special_tokens`` (as vLLM does).
Call ids are 9 letters/digits, the only form Mistral's chat templates accept back.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvflow.chat.tools_text import call_json
from kvflow.entrypoints.json_spans import object_members, skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    add_call,
    call_from_object,
    calls_or_content,
    is_json,
    until_marker,
)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    TOKEN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.TOKEN, final)
        if first < 0:
            return out
        pos = skip_ws(text, first + len(self.TOKEN))
        if pos < len(text) and text[pos] == "[":
            self._read_list(out, text, pos + 1)
        else:
            self._read_named(out, text, first)
        return calls_or_content(out, text, final)

    def _read_list(self, out: ParsedOutput, text: str, i: int) -> None:
        """The calls of the JSON list whose items start at ``text[i]``."""
        i = skip_ws(text, i)
        while i < len(text) and text[i] == "{":
            call, end = call_from_object(text, i, ("arguments",))
            if call.name is not None and not self.knows(call.name):
                return
            add_call(out, call, end)
            if end is None:
                return
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)

    def _read_named(self, out: ParsedOutput, text: str, pos: int) -> None:
        """The ``[TOOL_CALLS]name[ARGS]{...}`` calls from ``text[pos]`` on."""
        while text.startswith(self.TOKEN, pos):
            name_start = pos + len(self.TOKEN)
            args = text.find(self.ARGS, name_start)
            if args < 0:
                return  # the name is not complete yet
            name = text[name_start:args].split(self.CALL_ID, 1)[0].strip()
            if not _NAME.match(name) or not self.knows(name):
                return
            start = skip_ws(text, args + len(self.ARGS))
            if start >= len(text) or text[start] != "{":
                return  # a call is read (and streamed) from its "{" on
            end = object_members(text, start)[1]
            arguments = text[start:end]  # to the text's end while the object is open
            out.calls.append(ParsedCall(name, arguments, end is not None and is_json(arguments)))
            if end is None:
                return
            pos = skip_ws(text, end)

    def new_call_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = json.dumps(tools, ensure_ascii=False)
        return ("You can call the functions below. To call them, reply with [TOOL_CALLS] "
                'followed by a JSON list of calls: [{"name": function name, "arguments": '
                f"{{argument: value}}}}].\nFunctions:\n{listing}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.TOKEN}[{', '.join(call_json(c, 'arguments') for c in calls)}]"
