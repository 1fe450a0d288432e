"""/v1/responses beyond the reply itself, end to end on the tiny random model (the template
of test_openai_responses): output logprobs (oracle: chat's ``logprobs.content`` for the same
greedy request; the openai package's types parse every body and event), DELETE and
input_items (oracle: the request's items written by hand, OpenAI's ``ResponseItemList``).
Bad values are a 400 naming the field."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from openai.types.responses import ResponseItemList

from tests.e2e.test_openai_responses import (
    SERVER_ARGS,
    SHARED_ARGS,
    TOOLS,
    chat,
    output_text,
    respond,
    responses_model,
    streamed,
    whole,
)

LOGPROBS = ["message.output_text.logprobs"]


# ``server`` (test_openai_responses.py's, the session's) keeps its STORE_SIZE (4) replies; this
# module's own server keeps none
ARGS = SHARED_ARGS
NO_STORE_ARGS = [*SERVER_ARGS, "--responses-store-size", "0"]


def prestart_servers(fixture):
    """This module's own server (the shared one is test_openai_responses.py's)."""
    model = responses_model(fixture("tiny_llama"), fixture("built_models"))
    return [(model, NO_STORE_ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, tiny_llama, built_models):
    """The session's server of ``SHARED_ARGS`` (test_openai_responses.py's,
    ``start_server.shared``)."""
    return start_server.shared(responses_model(tiny_llama, built_models), SHARED_ARGS)


@pytest.fixture(scope="module")
def no_store_server(start_server, request):
    server = start_server.declared(request, 0)
    yield server
    server.terminate()


def event_form(entries: list[dict]) -> list[dict]:
    """Chat's logprobs entries in the stream events' form (no ``bytes``; hand-written)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


def close(got, want, tol: float = 1e-4) -> bool:
    """``got == want`` but for floats, equal within ``tol``: the oracle is a second request,
    whose prompt may come from the prefix cache (computed in other chunks, so the logprobs
    can differ in the last digits, as seen with KVFLOW_NATIVE_CPU=0)."""
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= tol
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and \
            all(close(got[k], want[k], tol) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and \
            all(close(g, w, tol) for g, w in zip(got, want))
    return got == want


# ---- output logprobs -----------------------------------------------------------------------------
@pytest.mark.parametrize("top", [None, 0, 3])
def test_output_text_logprobs_are_chats(server, top):
    """include message.output_text.logprobs: the part's logprobs equal chat's
    ``logprobs.content`` (tokens, logprobs, bytes, ``top`` alternatives) for the same greedy
    request; the streamed deltas carry them in order, the done event all of them."""
    extra = {} if top is None else {"top_logprobs": top}
    body = {"input": "the quick brown fox", "max_output_tokens": 12, "temperature": 0}
    reply = whole(server, include=LOGPROBS, **body, **extra)
    oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                  max_completion_tokens=12, temperature=0, logprobs=True, **extra)
    expected = oracle["choices"][0]["logprobs"]["content"]
    assert len(expected) == oracle["usage"]["completion_tokens"] == 12
    assert all(len(e["top_logprobs"]) == (top or 0) for e in expected)
    ((part,),) = [item["content"] for item in reply["output"]]
    assert close(part["logprobs"], expected)
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
    assert reply["top_logprobs"] == top
    events = streamed(server, include=LOGPROBS, **body, **extra)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    sent = [entry for e in deltas for entry in e["logprobs"]]
    assert sent and close(sent, event_form(expected)[:len(sent)])
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert close(done["logprobs"], event_form(expected))
    assert close(events[-1]["response"]["output"][0]["content"][0]["logprobs"], expected)


def test_without_include_no_logprobs(server):
    reply = whole(server, input="the quick", max_output_tokens=4, temperature=0)
    assert reply["output"][0]["content"][0]["logprobs"] == []
    events = streamed(server, input="the quick", max_output_tokens=4, temperature=0)
    assert all(e["logprobs"] == [] for e in events
               if e["type"] in ("response.output_text.delta", "response.output_text.done"))


def test_function_call_tokens_carry_no_logprobs(server):
    """Forced tool call: the reply is a function_call item (no output_text part); logprobs
    asked for are a 200 with none placed on a call."""
    reply = whole(server, input="the quick brown fox", tools=TOOLS, include=LOGPROBS,
                  tool_choice={"type": "function", "name": "add"}, max_output_tokens=40,
                  temperature=0)
    assert [i["type"] for i in reply["output"]][:1] == ["function_call"]
    assert all("logprobs" not in i for i in reply["output"] if i["type"] == "function_call")


def test_openai_client_reads_logprobs(server):
    resp = server.client().responses.create(
        model="tiny", input="hello there", max_output_tokens=6, temperature=0,
        include=LOGPROBS, top_logprobs=2)
    oracle = chat(server, [{"role": "user", "content": "hello there"}],
                  max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    logprobs = resp.output[0].content[0].logprobs
    assert close([[lp.token, lp.logprob, [t.token for t in lp.top_logprobs]] for lp in logprobs],
                 [[e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]]
                  for e in oracle["choices"][0]["logprobs"]["content"]])


def test_openai_stream_helper_keeps_the_logprobs(server):
    """The client's ``responses.stream`` helper: its text events carry the delta logprobs
    and its last event's response (``response.incomplete``: cut by max_output_tokens, so
    no get_final_response) the part's, equal to the whole reply's."""
    body = {"input": "hello there", "max_output_tokens": 6, "temperature": 0,
            "include": LOGPROBS, "top_logprobs": 1}
    reply = whole(server, **body)
    with server.client().responses.stream(model="tiny", **body) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    expected = reply["output"][0]["content"][0]["logprobs"]
    assert close([lp.model_dump() for lp in final.output[0].content[0].logprobs], expected)
    sent = [lp.model_dump(exclude_none=True) for e in deltas for lp in e.logprobs]
    assert sent and close(sent, event_form(expected)[:len(sent)])


BAD_LOGPROBS = [
    ({"top_logprobs": 21, "include": LOGPROBS}, "top_logprobs"),
    ({"top_logprobs": -1, "include": LOGPROBS}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without the include: nowhere to put them
    ({"include": [*LOGPROBS, "reasoning.encrypted_content"]}, "include.1"),
    ({"include": ["file_search_call.results"]}, "include.0"),
]


@pytest.mark.parametrize(("body", "param"), BAD_LOGPROBS, ids=[str(b) for b, _ in BAD_LOGPROBS])
def test_bad_logprobs_fields_are_a_400(server, body, param):
    resp = respond(server, input="hi", **body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


# ---- DELETE and input_items ----------------------------------------------------------------------
ITEMS = [{"role": "developer", "content": "be terse"},
         {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
         {"type": "message", "role": "assistant", "content": "hello", "id": "msg_given"},
         {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
         {"type": "function_call_output", "call_id": "c1", "output": "2"},
         {"role": "user", "content": "and?"}]


def input_items(server, response_id: str, **query) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/responses/{response_id}/input_items", params=query,
                     timeout=10)


def test_input_items_list_the_request_input(server):
    """The items come back in OpenAI's item types (ResponseItemList validates), newest first
    by default, with ids (the one given kept), and page with limit / after / order."""
    reply = whole(server, input=ITEMS, instructions="sys", tools=TOOLS, max_output_tokens=2)
    page = input_items(server, reply["id"])
    assert page.status_code == 200, page.text
    ResponseItemList.model_validate(page.json())
    data = page.json()["data"]
    # oldest first in asc order: the request's items, as written by hand
    asc = list(reversed(data))
    assert [(i["type"], i.get("role")) for i in asc] == [
        ("message", "developer"), ("message", "user"), ("message", "assistant"),
        ("function_call", None), ("function_call_output", None), ("message", "user")]
    assert asc[0]["content"] == [{"type": "input_text", "text": "be terse"}]
    assert asc[1]["content"] == [{"type": "input_text", "text": "hi"}]
    assert asc[2]["id"] == "msg_given"
    assert asc[2]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert (asc[3]["call_id"], asc[3]["arguments"], asc[4]["output"]) == ("c1", '{"a": 1}', "2")
    assert len({i["id"] for i in data}) == 6
    assert page.json()["first_id"] == data[0]["id"] and page.json()["last_id"] == data[-1]["id"]
    assert page.json()["has_more"] is False
    ids = [i["id"] for i in asc]
    first = input_items(server, reply["id"], order="asc", limit=4).json()
    assert [i["id"] for i in first["data"]] == ids[:4] and first["has_more"] is True
    rest = input_items(server, reply["id"], order="asc", limit=4, after=ids[3]).json()
    assert [i["id"] for i in rest["data"]] == ids[4:] and rest["has_more"] is False
    desc = input_items(server, reply["id"], limit=2, after=ids[4]).json()
    assert [i["id"] for i in desc["data"]] == [ids[3], ids[2]] and desc["has_more"] is True
    end = input_items(server, reply["id"], after=ids[0]).json()
    assert end == {"object": "list", "data": [], "first_id": None, "last_id": None,
                   "has_more": False}


def test_a_string_input_is_one_user_message_and_the_client_pages(server):
    reply = whole(server, input="hello", max_output_tokens=2)
    items = list(server.client().responses.input_items.list(reply["id"]))
    assert [(i.type, i.role, [c.text for c in i.content]) for i in items] == \
        [("message", "user", ["hello"])]


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
    ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"),
    ({"include": "message.input_image.image_url"}, "include"), ({"x": "1"}, "x")])
def test_bad_input_items_query_is_a_400_naming_it(server, query, param):
    reply = whole(server, input="hello", max_output_tokens=2)
    resp = input_items(server, reply["id"], **query)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_delete_forgets_the_reply(server):
    reply = whole(server, input="hello", max_output_tokens=2)
    url = f"{server.url}/v1/responses/{reply['id']}"
    deleted = httpx.delete(url, timeout=10)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": reply["id"], "object": "response.deleted", "deleted": True}
    for resp in (httpx.get(url, timeout=10), input_items(server, reply["id"]),
                 httpx.delete(url, timeout=10)):
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "response_not_found"
    follow = respond(server, input="x", previous_response_id=reply["id"])
    assert follow.status_code == 404
    assert follow.json()["error"]["param"] == "previous_response_id"
    other = whole(server, input="hello", max_output_tokens=2)
    assert server.client().responses.delete(other["id"]) is None  # the client's call: a 200
    assert httpx.get(f"{server.url}/v1/responses/{other['id']}", timeout=10).status_code == 404


def test_cancel_is_a_400_for_a_foreground_reply_and_a_404_for_none(server):
    """A reply not created with background true cannot be cancelled (OpenAI's rule; the
    background ones: test_openai_responses_background); an unknown id is a 404, a query
    parameter a 400 naming it."""
    reply = whole(server, input="hello", max_output_tokens=2)
    cancel = f"{server.url}/v1/responses/{reply['id']}/cancel"
    resp = httpx.post(cancel, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(
        "only a response created with background true can be cancelled")
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("response_id", "invalid_value")
    assert httpx.get(f"{server.url}/v1/responses/{reply['id']}",  # still stored, unchanged
                     timeout=10).json() == reply
    resp = httpx.post(cancel, params={"stream": "true"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
    resp = httpx.post(cancel, json={"x": 1}, timeout=10)
    assert resp.status_code == 400 and "takes no body" in resp.json()["error"]["message"]
    resp = httpx.post(f"{server.url}/v1/responses/resp_nothere/cancel", timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError, match="background true"):  # the client's call
        server.client().responses.cancel(reply["id"])


# ---- cached tokens -------------------------------------------------------------------------------
BLOCK_SIZE = int(ARGS[ARGS.index("--block-size") + 1])


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_the_prefix_cache_hits(server, stream):
    """A prompt whose first block no earlier request shared hits nothing; the same prompt
    again hits its whole blocks but the last token's (the engine computes at least one):
    ``((input_tokens - 1) // block_size) * block_size``, by hand."""
    words = " ".join(f"{uuid.uuid4().hex[:6]} lorem ipsum dolor" for _ in range(8))
    body = {"input": words, "max_output_tokens": 2, "temperature": 0}

    def usage():
        if stream:
            return streamed(server, **body)[-1]["response"]["usage"]
        return whole(server, **body)["usage"]

    first, second = usage(), usage()
    num_prompt = first["input_tokens"]
    assert num_prompt > 3 * BLOCK_SIZE
    assert first["input_tokens_details"]["cached_tokens"] == 0
    assert second["input_tokens_details"]["cached_tokens"] == \
        (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


# ---- the store's size ----------------------------------------------------------------------------
def test_the_store_keeps_the_last_store_size_replies(server):
    """--responses-store-size 4: after 5 stored replies the first is gone (404 on GET, on
    input_items and as previous_response_id), the 4 others are there."""
    ids = [whole(server, input=f"x{i}", max_output_tokens=1)["id"] for i in range(5)]
    got = [httpx.get(f"{server.url}/v1/responses/{i}", timeout=10).status_code for i in ids]
    assert got == [404, 200, 200, 200, 200]
    assert input_items(server, ids[0]).status_code == 404
    assert "--responses-store-size" in httpx.get(
        f"{server.url}/v1/responses/{ids[0]}", timeout=10).json()["error"]["message"]
    assert respond(server, input="y", previous_response_id=ids[0]).status_code == 404


def test_store_size_0_keeps_nothing_and_says_so(no_store_server):
    """--responses-store-size 0: a reply echoes store false and is not kept (404); sending
    store true itself is a 400 naming store; store false is a 200."""
    reply = whole(no_store_server, input="hello", max_output_tokens=2)
    assert reply["store"] is False
    got = httpx.get(f"{no_store_server.url}/v1/responses/{reply['id']}", timeout=10)
    assert got.status_code == 404
    assert "--responses-store-size 0" in got.json()["error"]["message"]
    refused = respond(no_store_server, input="hello", store=True)
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == \
        ("store", "unsupported_parameter")
    assert whole(no_store_server, input="hello", max_output_tokens=2, store=False)["store"] \
        is False
    events = streamed(no_store_server, input="hello", max_output_tokens=2)
    assert events[0]["response"]["store"] is False and events[-1]["response"]["store"] is False


# ---- empty input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "code"), [("", "empty_string"), ([], "empty_array")])
def test_empty_input_is_a_400_naming_input(server, value, code):
    """OpenAI's answer to an empty string / list (its message form and code), whole and
    streamed, before anything is queued."""
    for stream in (False, True):
        resp = respond(server, input=value, stream=stream)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"], error["type"]) == \
            ("input", code, "invalid_request_error")
        assert error["message"].startswith("Invalid 'input': empty")


def test_a_one_space_input_is_served(server):
    """Not empty: a one-space message is a turn like any other (chat's reply for it)."""
    reply = whole(server, input=" ", max_output_tokens=3, temperature=0)
    oracle = chat(server, [{"role": "user", "content": " "}], max_completion_tokens=3,
                  temperature=0)
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
