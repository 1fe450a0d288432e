"""A Responses API reply's output items, built from the chat parser's deltas, and the stream
events that announce them (OpenAI's event sequence). The whole (non-streamed) reply is built
by the same code from one delta holding all the text, so streamed and whole replies carry the
same items.

Per item, the events are (each with ``sequence_number`` counting from the response's
``response.created``, 0):
- message: ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` (one per delta), ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``;
- reasoning (``--reasoning-parser``): the same with ``response.reasoning_text.delta`` /
  ``.done`` and a ``reasoning_text`` part;
- function_call: ``response.output_item.added``, ``response.function_call_arguments.delta``,
  ``response.function_call_arguments.done``, ``response.output_item.done``.
An item is done when another starts or the reply ends; the one the reply's end closes takes
the reply's status (``incomplete`` when cut by ``max_output_tokens``). A function call whose
arguments are not a JSON object's text when it closes (an EOS inside them, malformed JSON) is
``incomplete`` too.

Output logprobs (``include: ["message.output_text.logprobs"]``): each engine delta's tokens
are held until the parser turns their text into something. Text of the message: they are the
``logprobs`` of that ``response.output_text.delta`` event (OpenAI's event form: ``token``,
``logprob``, ``top_logprobs``) and are appended to the ``output_text`` part's (the part form
adds ``bytes``, as chat's ``logprobs.content`` entries). Reasoning or a function call: they
are dropped (OpenAI gives logprobs on output_text only). Tokens whose text never showed (an
EOS, a stop string's) join the last message's part when the reply ends, so for a reply that
is all message text the part holds every generated token, as chat's ``logprobs.content``
does; ``response.output_text.done`` carries the whole part's list.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvflow.chat.tool_calls import is_object_text
from kvflow.entrypoints.tool_parsers import StreamDelta

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """``{prefix}_{32 hex digits}`` (``resp``, ``msg``, ``fc``, ``call``, ``rs``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


async def sse_lines(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """The events as SSE: ``event: <type>`` + ``data: <json>`` each."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part-form logprobs (``token``, ``bytes``, ``logprob``, ``top_logprobs``) in the stream
    events' form (OpenAI's ``ResponseTextDeltaEvent.Logprob``: no ``bytes``)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


class ResponseEvents:
    """The output items of one reply and its event counter. Each method returns the events
    its change produced (a caller that does not stream drops them)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self._open: str | None = None  # the kind of the last item while it is open
        self._calls: dict[int, int] = {}  # tool-call index -> output index
        self._pending: list[dict[str, Any]] = []  # logprobs of tokens not yet placed
        # the reply's token counts so far (a ResponseUsage), set by the run once it has its
        # prompt: a cancelled background reply reports them
        self.usage: Callable[[], Any] | None = None

    def event(self, kind: str, **fields: Any) -> Event:
        """An event of type ``kind`` with the next sequence number (``fields`` copied)."""
        out = {"type": kind, "sequence_number": self.sequence_number,
               **copy.deepcopy(fields)}
        self.sequence_number += 1
        return out

    def feed(self, delta: StreamDelta, logprobs: list[dict[str, Any]] = ()) -> list[Event]:
        """The events of one parsed delta: reasoning, then content, then tool calls.
        ``logprobs``: the part-form entries (chat's ``logprobs.content`` dicts) of the tokens
        the delta's text came from (see the module's docstring for where they go)."""
        self._pending += logprobs
        events = self._text("reasoning", delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self._text("message", delta.content)
        elif delta.reasoning or delta.tool_calls:
            self._pending = []
        for index, call_id, name, arguments in delta.tool_calls:
            events += self._call(index, name, arguments) if call_id else \
                self._arguments(index, arguments)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item with ``status`` (``completed`` / ``incomplete``); a reply with
        no item at all gets an empty message (its ``output_text`` is "")."""
        events = [] if self.items else self._open_message()
        last = self.items[-1]
        if last["type"] == "message":
            last["content"][0]["logprobs"] += self._pending
        self._pending = []
        return events + self._close(status)

    # ---- text items --------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open != kind:
            events = self._close("completed")
            events += self._open_message() if kind == "message" else self._open_reasoning()
        index = len(self.items) - 1
        item = self.items[index]
        item["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        extra = {}
        if kind == "message":
            item["content"][0]["logprobs"] += self._pending
            extra, self._pending = {"logprobs": event_logprobs(self._pending)}, []
        return events + [self.event(f"response.{name}.delta", item_id=item["id"],
                                    output_index=index, content_index=0, delta=text, **extra)]

    def _open_message(self) -> list[Event]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        return self._open_text_item("message", item, part)

    def _open_reasoning(self) -> list[Event]:
        item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                "status": "in_progress"}
        return self._open_text_item("reasoning", item, {"type": "reasoning_text", "text": ""})

    def _open_text_item(self, kind: str, item: dict[str, Any], part: dict[str, Any]
                        ) -> list[Event]:
        index = len(self.items)
        self.items.append(item)
        self._open = kind
        events = [self.event("response.output_item.added", output_index=index, item=item)]
        item["content"].append(part)
        return events + [self.event("response.content_part.added", item_id=item["id"],
                                    output_index=index, content_index=0, part=part)]

    # ---- function calls ----------------------------------------------------------------------
    def _call(self, index: int, name: str, arguments: str) -> list[Event]:
        events = self._close("completed")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": new_id("call"),
                "name": name, "arguments": "", "status": "in_progress"}
        self._calls[index] = len(self.items)
        self.items.append(item)
        self._open = "function_call"
        events.append(self.event("response.output_item.added",
                                 output_index=self._calls[index], item=item))
        return events + (self._arguments(index, arguments) if arguments else [])

    def _arguments(self, index: int, arguments: str) -> list[Event]:
        output_index = self._calls[index]
        item = self.items[output_index]
        item["arguments"] += arguments
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=output_index, delta=arguments)]

    # ---- closing -----------------------------------------------------------------------------
    def _close(self, status: str) -> list[Event]:
        """Close the open item with ``status``. A function call whose arguments are not a JSON
        object's text (the model's EOS came inside them, or it wrote malformed JSON or no
        object) is ``incomplete`` whatever ``status`` says: no client could run it, and the
        stored conversation leaves it out (no output can answer it)."""
        if self._open is None:
            return []
        index, kind = len(self.items) - 1, self._open
        item, self._open = self.items[index], None
        if kind == "function_call" and not is_object_text(item["arguments"]):
            status = "incomplete"  # no usable call: see the docstring
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **ids,
                                 name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            name = "output_text" if kind == "message" else "reasoning_text"
            extra = {"logprobs": event_logprobs(part["logprobs"])} if kind == "message" else {}
            events = [self.event(f"response.{name}.done", **ids, content_index=0,
                                 text=part["text"], **extra),
                      self.event("response.content_part.done", **ids, content_index=0,
                                 part=part)]
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=item)]
