"""The server's in-memory store of Responses API replies (``store: true``, OpenAI's default):
GET /v1/responses/{id} returns a stored reply, GET /v1/responses/{id}/input_items its input
items (a page of them: ``item_page``), DELETE /v1/responses/{id} forgets it, and
``previous_response_id`` continues its conversation. Bounded: past ``capacity`` replies the least recently stored or read is
dropped (a later reference to it is a 404), never one that still runs in the background
(``hold`` / ``release``; at most ``capacity`` run at once: ``can_hold``). Nothing is written
to disk; a restart forgets everything, as vLLM's store does."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.protocol.responses_api import ResponseItemList, ResponseObject
from kvflow.entrypoints.structured_requests import RequestFieldError

if TYPE_CHECKING:
    from kvflow.entrypoints.responses_background import EventLog

# Replies kept per server by default (--responses-store-size): each holds its conversation's
# text, so a bound keeps a long-running server's memory flat (1,000 replies of a 4k-token
# context: ~16 MiB of text).
DEFAULT_CAPACITY = 1000


@dataclass
class StoredResponse:
    """A stored reply and its conversation as chat messages (the turns before it, without
    its ``instructions``, which OpenAI does not carry over, then its output as assistant
    turns); ``input_items``: its request's ``input`` as OpenAI lists it back
    (``responses_input.input_items``: the items of that request only, oldest first);
    ``log``: the stream events of a response created with ``background`` and ``stream``
    (replayed by GET /v1/responses/{id}?stream=true), else None."""

    response: ResponseObject
    messages: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    log: EventLog | None = None


class ResponseStore:
    """Replies by id, at most ``capacity`` (least recently used dropped first; 0: the store
    is off and keeps nothing, ``--responses-store-size 0``).

    Raises:
        ValueError: from the constructor for a negative ``capacity``.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._held: set[str] = set()  # ids of responses running in the background

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a reply as the most recently used; past ``capacity``, drop the
        least recently used ones that are not held (there is always one: at most
        ``capacity`` are held)."""
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        if len(self._items) <= self.capacity:
            return
        idle = [i for i in self._items if i not in self._held]
        for response_id in idle[:len(self._items) - self.capacity]:
            del self._items[response_id]

    def can_hold(self) -> bool:
        """Whether one more background response may run (fewer than ``capacity`` do)."""
        return len(self._held) < self.capacity

    def hold(self, stored: StoredResponse) -> None:
        """Store a background response that starts running; it is not dropped until
        ``release``. Call only when ``can_hold()``.

        Raises:
            ValueError: when ``capacity`` responses are held already.
        """
        if not self.can_hold():
            raise ValueError(f"{len(self._held)} background responses run already "
                             f"(capacity {self.capacity})")
        self._held.add(stored.response.id)
        self.put(stored)

    def release(self, response_id: str) -> None:
        """The background response ended: it may be dropped like any other (no-op for an id
        not held)."""
        self._held.discard(response_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def peek(self, response_id: str) -> StoredResponse | None:
        """The stored reply (or None), without making it the most recently used."""
        return self._items.get(response_id)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored reply, or None when it was never stored or was dropped."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a reply; False when none of that id is stored."""
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


# GET /v1/responses/{id}/input_items query parameters (OpenAI's): defaults and limits
DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT = 20, 100


def item_page(items: Sequence[dict[str, Any]], query: Mapping[str, list[str]]
              ) -> ResponseItemList:
    """A page of ``items`` (oldest first) as OpenAI's list object. ``query``: each query
    parameter's values: ``order`` ``desc`` (newest first, the default) or ``asc``, ``limit``
    1-100 (default 20), ``after`` an item id (the page starts after it, in that order).
    ``first_id`` / ``last_id`` are null for an empty page.

    Raises:
        RequestFieldError: naming the parameter: a bad value, one given twice, ``after`` not
            an id of these items, ``include`` (kvflow has no extra item data) or another
            parameter.
    """
    order, limit, after = "desc", DEFAULT_PAGE_LIMIT, None
    for name, values in query.items():
        if name not in ("order", "limit", "after"):
            raise RequestFieldError(f"the query parameter {name} is not supported by kvflow "
                                    "(it reads order, limit, after)", name,
                                    "unsupported_parameter")
        if len(values) != 1:
            raise RequestFieldError(f"{name} given {len(values)} times", name)
    if "order" in query:
        order = query["order"][0]
        if order not in ("asc", "desc"):
            raise RequestFieldError(f"order must be asc or desc; got {order!r}", "order")
    if "limit" in query:
        limit = _limit(query["limit"][0])
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if "after" in query:
        after = query["after"][0]
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise RequestFieldError(f"after={after!r} is not an input item of this response",
                                    "after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return ResponseItemList(data=data, first_id=data[0]["id"] if data else None,
                            last_id=data[-1]["id"] if data else None,
                            has_more=start + limit < len(ordered))


def _limit(value: str) -> int:
    if not value.lstrip("-").isdigit() or not 1 <= int(value) <= MAX_PAGE_LIMIT:
        raise RequestFieldError(f"limit must be an integer from 1 to {MAX_PAGE_LIMIT}; got "
                                f"{value!r}", "limit")
    return int(value)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's output items as chat turns: message text as an assistant turn, function
    calls as its ``tool_calls`` (reasoning items are not rendered again, as chat templates
    drop earlier turns' reasoning). A call the reply's end cut (status ``incomplete``: by
    ``max_output_tokens``, a cancel, or an EOS inside its arguments; malformed arguments too)
    is no call: its arguments are no JSON object's text, no client can run it, and no output
    can answer it."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output
             if item["type"] == "function_call" and item["status"] == "completed"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
