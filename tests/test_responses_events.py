"""/v1/responses' pieces without a server: output items and stream events from the chat
parser's deltas (``responses_events``), input items -> chat messages (``responses_input``),
the bounded store. Oracles: the openai package's pydantic types (every event and the items
validate), hand-written event orders, the whole text fed at once giving the same items as
the text fed in pieces, and the chat messages written by hand."""

from __future__ import annotations

import copy

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvflow.entrypoints.protocol.responses_api import ResponseObject, TextFormat
from kvflow.entrypoints.responses_events import ResponseEvents
from kvflow.entrypoints.responses_input import (
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
)
from kvflow.entrypoints.responses_store import ResponseStore, StoredResponse, output_messages
from kvflow.entrypoints.structured_requests import RequestFieldError
from kvflow.entrypoints.tool_parsers import (
    StreamingToolState,
    ThinkReasoningParser,
    make_tool_parser,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
TEXT = f"<think>let me see</think>Sure.{CALL}"


def run(pieces: list[str], status: str = "completed") -> tuple[list[dict], list[dict]]:
    """Feed ``pieces`` through a think + Hermes parser state: (events, items)."""
    state = StreamingToolState(make_tool_parser("hermes"), ThinkReasoningParser())
    events = ResponseEvents()
    out = []
    for i, piece in enumerate(pieces):
        out += events.feed(state.update(piece, i == len(pieces) - 1))
    out += events.finish(status)
    return out, events.items


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_text_and_call_items_and_events():
    events, items = run([TEXT[i:i + 3] for i in range(0, len(TEXT), 3)])
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert compact == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "let me see"}]
    assert items[1]["content"][0]["text"] == "Sure."
    assert (items[2]["name"], items[2]["arguments"]) == ("add", '{"a": 1}')
    deltas = "".join(e["delta"] for e in events
                     if e["type"] == "response.function_call_arguments.delta")
    assert deltas == '{"a": 1}'
    # each item's done event carries the item as it ends, added carries it empty
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == items
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[1]["content"] == [] and added[2]["arguments"] == ""


def test_whole_text_gives_the_streamed_items():
    _, streamed = run([TEXT[i:i + 2] for i in range(0, len(TEXT), 2)])
    _, whole = run([TEXT])
    assert without_ids(whole) == without_ids(streamed)
    reply = ResponseObject(id="resp_1", created_at=0, status="completed", model="m",
                           output=whole)
    parsed = Response.model_validate(reply.model_dump())
    assert parsed.output_text == "Sure."


def _lp(token: str) -> dict:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": -1.0, "bytes": list(token.encode())}]}


def test_logprobs_go_to_the_text_their_tokens_made():
    """One token per piece: the reasoning's tokens are dropped, a token held back (``<th``
    of ``</think>``) goes with the text that follows it, the message's tokens go on its
    deltas and part, and a token of no text at the end (EOS) joins the part."""
    pieces = ["<think>", "ab", "</th", "ink>", "Su", "re", ""]
    state = StreamingToolState(None, ThinkReasoningParser())
    events, out = ResponseEvents(), []
    for i, piece in enumerate(pieces):
        out += events.feed(state.update(piece, i == len(pieces) - 1), [_lp(f"t{i}")])
    out += events.finish("completed")
    for event in out:
        EVENTS.validate_python(event)
    deltas = [e for e in out if e["type"] == "response.output_text.delta"]
    # t2 ("</th") and t3 ("ink>") made no text alone: they come with the first content
    assert [[lp["token"] for lp in e["logprobs"]] for e in deltas] == \
        [["t2", "t3", "t4"], ["t5"]]
    assert "bytes" not in deltas[0]["logprobs"][0]
    message = events.items[-1]
    assert message["content"][0]["logprobs"] == [_lp(t) for t in ("t2", "t3", "t4", "t5", "t6")]
    (done,) = [e for e in out if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done["logprobs"]] == ["t2", "t3", "t4", "t5", "t6"]
    reply = ResponseObject(id="resp_1", created_at=0, status="completed", model="m",
                           output=events.items)
    Response.model_validate(reply.model_dump())


def test_empty_reply_is_one_empty_message_and_incomplete_marks_the_last_item():
    _, items = run([""], "incomplete")
    assert [i["type"] for i in items] == ["message"] and items[0]["content"][0]["text"] == ""
    assert items[0]["status"] == "incomplete"
    _, items = run(["<think>abc</think>de"], "incomplete")
    assert [i["status"] for i in items] == ["completed", "incomplete"]


def test_input_items_as_chat_messages():
    conv = chat_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "b", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "h", "arguments": "{}"},
    ], "sys", earlier=[{"role": "user", "content": "before"}])
    call = lambda i, n, a: {"id": i, "type": "function",
                            "function": {"name": n, "arguments": a}}
    assert conv.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "before"},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}],
         "tool_calls": [call("c1", "f", "{}"), call("c2", "g", "[]")]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "h", "{}")]}]
    assert conv.paths == ["instructions", "previous_response_id", "input.0", "input.1",
                          "input.4", "input.6"]
    assert conv.call_paths == {3: ["input.2", "input.3"], 5: ["input.6"]}
    assert chat_messages("hi", None).messages == [{"role": "user", "content": "hi"}]
    parts = chat_messages([{"type": "function_call_output", "call_id": "c",
                            "output": [{"type": "input_text", "text": "x"}]}], None)
    assert parts.messages == [{"role": "tool", "tool_call_id": "c",
                               "content": [{"type": "text", "text": "x"}]}]


def test_a_call_after_a_stored_turn_leaves_that_turn_alone():
    """A function_call item right after ``previous_response_id``'s last assistant turn joins
    that turn in this conversation only: the stored turns (``earlier``, the store's own
    list) are unchanged, so another request continuing the same reply renders the same
    prompt (they used to gain the call)."""
    earlier = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "A", "tool_calls": [
                   {"id": "c0", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]}]
    before = copy.deepcopy(earlier)
    conv = chat_messages([
        {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "[]"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}], None, earlier)
    assert earlier == before
    assert [c["id"] for c in conv.messages[1]["tool_calls"]] == ["c0", "c1"]
    assert conv.messages[1]["content"] == "A"
    assert conv.call_paths == {1: ["previous_response_id", "input.0"]}
    again = chat_messages("next", None, earlier)
    assert again.messages == [*before, {"role": "user", "content": "next"}]


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"role": "user", "content": []}], "input.0.content"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input.0.content.0.type"),
    ([{"role": "user", "content": "a", "name": "n"}], "input.0.name"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input.0.arguments"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input.0.output"),
    ([{"type": "function_call_output", "call_id": "c",
       "output": [{"type": "input_image", "image_url": "x"}]}], "input.0.output.0.type"),
    ([{"type": "item_reference", "id": "x"}], "input.0.type"),
    ([], "input"),
])
def test_bad_input_items_name_their_path(items, param):
    with pytest.raises(RequestFieldError) as info:
        chat_messages(items, None)
    assert info.value.param == param


def test_tools_choice_and_format_in_chat_terms():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(RequestFieldError, match="code_interpreter") as info:
        chat_tools([tool, {"type": "code_interpreter"}])
    assert info.value.param == "tools.1.type"
    assert chat_tool_choice({"type": "function", "name": "f"}) == \
        {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    with pytest.raises(RequestFieldError):
        chat_tool_choice({"type": "web_search_preview"})
    fmt = TextFormat.model_validate({"type": "json_schema", "name": "x",
                                     "schema": {"type": "object"}})
    assert chat_response_format(fmt) == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    with pytest.raises(RequestFieldError) as info:
        chat_response_format(TextFormat.model_validate({"type": "text", "name": "x"}))
    assert info.value.param == "text.format.name"


def test_store_is_bounded_and_least_recently_used_goes_first():
    store = ResponseStore(capacity=2)
    replies = [ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model="m")
               for i in range(3)]
    store.put(StoredResponse(replies[0], []))
    store.put(StoredResponse(replies[1], []))
    assert store.get("resp_0").response is replies[0]  # now the most recently used
    store.put(StoredResponse(replies[2], []))
    assert store.get("resp_1") is None and len(store) == 2
    assert store.get("resp_0") is not None and store.get("resp_2") is not None
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(-1)


def test_output_as_chat_turns():
    _, items = run([TEXT])
    (turn,) = output_messages(items)
    assert turn["content"] == "Sure." and turn["role"] == "assistant"
    assert [c["function"] for c in turn["tool_calls"]] == [{"name": "add",
                                                             "arguments": '{"a": 1}'}]
    assert turn["tool_calls"][0]["id"] == items[2]["call_id"]


# ---- the handler's stream, with a fake engine stream ---------------------------------------------
class _Stream:
    """A request stream yielding ``pieces`` as delta outputs, then raising ``error`` (or
    finishing with ``finish``)."""

    def __init__(self, pieces, finish="stop", error=None):
        self.pieces, self.finish, self.error = pieces, finish, error

    async def __aiter__(self):
        from types import SimpleNamespace

        from kvflow.outputs import CompletionOutput

        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1 and self.error is None
            yield SimpleNamespace(outputs=[CompletionOutput(
                0, piece, [i], finish_reason=self.finish if last else None)],
                metrics=SimpleNamespace(num_cached_tokens=2))
        if self.error is not None:
            raise self.error


def _handler_events(stream, tool_parser=None):
    """(events, the handler) of a streamed reply of ``stream`` under a think parser (and
    ``tool_parser``); the fake tokenizer makes one token per character."""
    import asyncio
    from types import SimpleNamespace

    from kvflow.entrypoints.chat_output import ChatOutputParser
    from kvflow.entrypoints.protocol.responses_api import ResponsesRequest
    from kvflow.entrypoints.serving_chat import ChatRun
    from kvflow.entrypoints.serving_responses import OpenAIServingResponses

    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: list(text))
    chat = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer),
                           response_model=lambda model: "m")
    handler = OpenAIServingResponses(chat)
    req = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    run = ChatRun("resp-1", [1, 2, 3], [stream],
                  ChatOutputParser(tool_parser, ThinkReasoningParser()))

    async def drain():
        from kvflow.entrypoints.responses_input import chat_messages

        skeleton = handler._skeleton(req, "resp_1")
        return [e async for e in handler._events(req, run, skeleton, chat_messages("hi", None))]

    return asyncio.run(drain()), handler


def test_streamed_reply_counts_reasoning_tokens_and_is_stored():
    events, handler = _handler_events(_Stream(["<thi", "nk>ab</th", "ink>cd"], "length"))
    for event in events:
        EVENTS.validate_python(event)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    response = final["response"]
    assert response["usage"]["output_tokens"] == 3 and response["usage"]["input_tokens"] == 3
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # "ab"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 2  # the engine's
    assert [i["type"] for i in response["output"]] == ["reasoning", "message"]
    assert handler.store.get("resp_1").messages == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "cd"}]


def test_a_call_cut_by_max_output_tokens_is_not_stored_as_a_call():
    """A reply cut mid-call: the call item is ``incomplete`` in the output (OpenAI's), and
    the stored conversation has no such call, whose unfinished arguments made every
    ``previous_response_id`` continuation a 400; a finished call before it is kept."""
    events, calls, turn = _done_call_then('<tool_call>{"name": "add", "arguments": {"a',
                                          "length")
    assert events[-1]["type"] == "response.incomplete"
    assert [(c["arguments"], c["status"]) for c in calls] == [
        ('{"a": 1}', "completed"), ('{"a', "incomplete")]
    assert turn["content"] == "Sure."
    _assert_only_the_done_call_stored(turn, calls)


def _done_call_then(last: str, finish_reason: str) -> tuple[list, list, dict]:
    """A hermes reply "Sure." + a finished ``add`` call + ``last``, ending with
    ``finish_reason``: (its events, its function_call items, the stored assistant turn)."""
    done = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    events, handler = _handler_events(_Stream(["Sure.", done, last], finish_reason),
                                      make_tool_parser("hermes"))
    calls = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
    (_, turn) = handler.store.get("resp_1").messages
    return events, calls, turn


def _assert_only_the_done_call_stored(turn: dict, calls: list) -> None:
    assert turn["tool_calls"] == [{"id": calls[0]["call_id"], "type": "function",
                                   "function": {"name": "add", "arguments": '{"a": 1}'}}]


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "add", "arguments": {"a',  # the model's EOS inside the arguments
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # malformed JSON
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # JSON, not an object
], ids=["eos-in-arguments", "malformed", "not-an-object"])
def test_a_call_without_usable_arguments_is_incomplete_and_not_stored(bad):
    """A reply that ended normally (EOS, status ``completed``) with a call whose arguments are
    not a JSON object's text: the item is ``incomplete``, not ``completed`` (it was, and the
    stored conversation kept it, so every previous_response_id continuation was a 400 naming
    its arguments). vLLM 0.32's hermes parser, the oracle for the call itself, streams such a
    call too (its whole reply drops it for the text); a finished call before it is kept."""
    events, calls, turn = _done_call_then(bad, "stop")
    assert events[-1]["type"] == "response.completed"
    assert [c["status"] for c in calls] == ["completed", "incomplete"]
    done_events = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"
                   and e["item"]["type"] == "function_call"]
    assert done_events == ["completed", "incomplete"]  # the stream says so too
    _assert_only_the_done_call_stored(turn, calls)


def test_engine_death_mid_stream_is_an_error_event():
    from kvflow.engine.streams import EngineDeadError

    events, handler = _handler_events(_Stream(["a", "b"], error=EngineDeadError("gone")))
    for event in events:
        EVENTS.validate_python(event)
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["code"] == "engine_dead" and "gone" in events[-1]["message"]
    assert events[-1]["sequence_number"] == len(events) - 1
    assert handler.store.get("resp_1") is None  # a failed reply is not stored


@pytest.mark.parametrize(("chat_param", "param"), [
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("tools.1.function.parameters", "tools.1.parameters"),
    ("tool_choice", "tool_choice"), ("messages", "input"),
    ("messages.0.content", "instructions"),
    ("messages.2.tool_call_id", "input.1.call_id"),
    ("messages.1.content.0.text", "input.0.content.0.text"),
    ("messages.3.tool_calls.1.function.arguments", "input.3.arguments"),
    ("messages.3.tool_calls.0.id", "input.2.call_id"),
    ("messages.3.tool_calls", "input.2"),
    ("tool_choice.function.name", "tool_choice.name"),
])
def test_chat_error_fields_are_named_as_the_request_names_them(chat_param, param):
    from kvflow.entrypoints.responses_errors import renamed

    call = {"type": "function_call", "name": "f", "arguments": "{}"}
    conv = chat_messages([{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                          {"type": "function_call_output", "call_id": "c", "output": "1"},
                          {**call, "call_id": "c1"}, {**call, "call_id": "c2"}], "sys")
    assert renamed(chat_param, conv) == param


@pytest.mark.parametrize(("chat_param", "param"), [
    ("messages.1.tool_calls.1.function.arguments", "input.0.arguments"),
    ("messages.1.tool_calls.2.id", "input.1.call_id"),
    ("messages.1.tool_calls.0.function.arguments", "previous_response_id"),
])
def test_a_call_joining_a_stored_turn_with_calls_is_named_by_its_item(chat_param, param):
    """Calls joining ``previous_response_id``'s last turn, which made a call already: an
    error in one names its input item (the stored call, the earlier reply), not the stored
    call's place (they were counted from the turn's first call, the stored one)."""
    from kvflow.entrypoints.responses_errors import renamed

    earlier = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c0", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]}]
    call = {"type": "function_call", "name": "f", "arguments": "bad"}
    conv = chat_messages([{**call, "call_id": "c1"}, {**call, "call_id": "c2"}], None,
                         earlier)
    assert [c["id"] for c in conv.messages[1]["tool_calls"]] == ["c0", "c1", "c2"]
    assert renamed(chat_param, conv) == param


# ---- the unhonoured fields: one table --------------------------------------------------------
def test_every_untyped_field_is_marked_unhonoured_and_refused():
    """A request field typed ``Any`` is there only to be refused: each carries an
    ``Unhonoured`` mark (so ``refuse_unhonoured`` sees it), and a value other than its
    harmless one is a 400 naming it, while the harmless one passes."""
    from typing import Any

    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol.responses_api import ResponsesRequest, unhonoured_fields
    from kvflow.entrypoints.responses_checks import refuse_unhonoured

    marked = unhonoured_fields()
    untyped = {name for name, info in ResponsesRequest.model_fields.items()
               if info.annotation is Any}
    assert set(marked) == untyped and len(marked) == 10  # background is honoured
    for name, mark in marked.items():
        refuse_unhonoured(ResponsesRequest.model_validate({"input": "hi", name: mark.harmless}))
        with pytest.raises(OpenAIError) as info:
            refuse_unhonoured(ResponsesRequest.model_validate({"input": "hi", name: "x"}))
        assert (info.value.param, info.value.code) == (name, "unsupported_parameter")
        assert mark.instead in str(info.value)


@pytest.mark.parametrize(("query", "ids", "has_more"), [
    ({}, ["i4", "i3", "i2", "i1", "i0"], False),
    ({"order": ["asc"], "limit": ["2"]}, ["i0", "i1"], True),
    ({"order": ["asc"], "after": ["i2"]}, ["i3", "i4"], False),
    ({"after": ["i2"], "limit": ["1"]}, ["i1"], True),
    ({"limit": ["100"], "after": ["i0"]}, [], False)])
def test_item_page_orders_and_pages(query, ids, has_more):
    """Five items i0..i4 (oldest first), paged by hand."""
    from kvflow.entrypoints.responses_store import item_page

    page = item_page([{"id": f"i{k}"} for k in range(5)], query)
    assert ([i["id"] for i in page.data], page.has_more) == (ids, has_more)
    assert (page.first_id, page.last_id) == ((ids[0], ids[-1]) if ids else (None, None))


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": ["1", "2"]}, "limit"), ({"limit": ["-1"]}, "limit"), ({"limit": ["2.5"]}, "limit"),
    ({"order": ["DESC"]}, "order"), ({"after": ["i9"]}, "after"), ({"include": ["x"]}, "include")])
def test_item_page_names_a_bad_parameter(query, param):
    from kvflow.entrypoints.responses_store import item_page

    with pytest.raises(RequestFieldError) as info:
        item_page([{"id": "i0"}], query)
    assert info.value.param == param
