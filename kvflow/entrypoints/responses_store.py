"""The server's in-memory store of Responses API replies (``store: true``, OpenAI's default):
GET /v1/responses/{id} returns a stored reply, and ``previous_response_id`` continues its
conversation. Bounded: past ``capacity`` replies the least recently stored or read is
dropped (a later reference to it is a 404). Nothing is written to disk; a restart forgets
everything, as vLLM's store does."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvflow.entrypoints.protocol.responses_api import ResponseObject

# Replies kept per server: each holds its conversation's text, so a bound keeps a long-running
# server's memory flat (1,000 replies of a 4k-token context: ~16 MiB of text).
DEFAULT_CAPACITY = 1000


@dataclass
class StoredResponse:
    """A stored reply and its conversation as chat messages (the turns before it, without
    its ``instructions``, which OpenAI does not carry over, then its output as assistant
    turns)."""

    response: ResponseObject
    messages: list[dict[str, Any]]


class ResponseStore:
    """Replies by id, at most ``capacity`` (least recently used dropped first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored reply, or None when it was never stored or was dropped."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def __len__(self) -> int:
        return len(self._items)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's output items as chat turns: message text as an assistant turn, function
    calls as its ``tool_calls`` (reasoning items are not rendered again, as chat templates
    drop earlier turns' reasoning)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
