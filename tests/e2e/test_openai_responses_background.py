"""/v1/responses ``background: true`` end to end on the tiny random model (the template of
test_openai_responses, a server of its own so its KV block count is this module's alone).
Oracles: the same request run in the foreground (greedy: same text, usage, status), the
openai package's ``Response`` / stream event types, hand-written status orders and sequence
numbers, and the engine's free KV block count (``kvflow:kv_cache_free_blocks``) back at its
start value after a cancel. The engine core is held with SIGSTOP (as test_openai_sleep does)
so that a response is certainly still queued or running when it is cancelled."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from openai.types.responses import Response

from tests.e2e.test_engine_faults import core_pid
from tests.e2e.test_openai_responses import (
    EVENTS,
    MODEL,
    SERVER_ARGS,
    assert_no_leak,
    output_text,
    respond,
    responses_model,
    whole,
)

STORE_SIZE = 3  # also the most background responses that run at once
ARGS = [*SERVER_ARGS, "--responses-store-size", str(STORE_SIZE)]
BODY = {"input": "the quick brown fox", "temperature": 0}
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
ORDER = ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


def prestart_servers(fixture):
    return [(responses_model(fixture("tiny_llama"), fixture("built_models")), ARGS, None)]


def get(server, response_id: str, **params) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/responses/{response_id}", params=params, timeout=30)


def cancel(server, response_id: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses/{response_id}/cancel", timeout=30)


def background(server, **body) -> dict:
    """POST with ``background`` true: answered at once, the response ``queued``."""
    resp = respond(server, background=True, **body)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    Response.model_validate(reply)
    assert (reply["status"], reply["background"], reply["output"]) == ("queued", True, [])
    return reply


def poll(server, response_id: str, timeout: float = 60) -> list[dict]:
    """Every GET body until the response ends (each checked as OpenAI's ``Response``)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = get(server, response_id)
        assert resp.status_code == 200, resp.text
        Response.model_validate(resp.json())
        seen.append(resp.json())
        if seen[-1]["status"] in TERMINAL:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"{response_id} still {seen[-1]['status']} after {timeout} s")


def sse_events(resp: httpx.Response, stop_after_deltas: int | None = None,
               lines: Iterator[str] | None = None) -> list[dict]:
    """The events of an SSE body (``event:`` line checked against the data's type, each
    validated as the openai package's stream event); stops reading after
    ``stop_after_deltas`` output_text deltas (the client leaves, or reads on from ``lines``,
    the body's line iterator)."""
    events, deltas = [], 0
    lines = resp.iter_lines() if lines is None else lines
    for line in lines:
        if not line:
            continue
        data = next(lines)
        event = json.loads(data.removeprefix("data: "))
        assert line == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
        deltas += event["type"] == "response.output_text.delta"
        if deltas == stop_after_deltas:
            break
    return events


def delta_text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@contextlib.contextmanager
def core_held(server):
    """The engine core stopped (SIGSTOP) within: nothing it was sent runs until the end."""
    core = core_pid(server.proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core, signal.SIGCONT)


# ---- polling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [6, 40])
def test_polled_background_response_is_the_foreground_ones(server, max_tokens):
    """The polled response ends as the same request run in the foreground (greedy): same
    output text, usage and status; the statuses seen go forward only, queued first."""
    oracle = whole(server, **BODY, max_output_tokens=max_tokens)
    reply = background(server, **BODY, max_output_tokens=max_tokens)
    seen = poll(server, reply["id"])
    statuses = [r["status"] for r in seen]
    assert statuses == sorted(statuses, key=ORDER.index), statuses
    final = seen[-1]
    assert final["status"] == oracle["status"]
    assert output_text(final) == output_text(oracle) and output_text(final)
    assert final["usage"]["output_tokens"] == oracle["usage"]["output_tokens"]
    assert final["usage"]["input_tokens"] == oracle["usage"]["input_tokens"]
    assert (final["id"], final["background"], final["created_at"]) == \
        (reply["id"], True, reply["created_at"])
    # a finished background response: cancel returns it unchanged (OpenAI's rule)
    resp = cancel(server, reply["id"])
    assert resp.status_code == 200 and resp.json() == final
    # and it continues a conversation like any stored reply
    follow = whole(server, input="and then", previous_response_id=reply["id"],
                   max_output_tokens=2)
    assert follow["previous_response_id"] == reply["id"]


def test_polling_shows_the_text_generated_so_far(server):
    """While a long greedy response runs, each GET shows the text generated so far (OpenAI's
    polling): status ``in_progress``, one message item ``in_progress`` whose text is a
    prefix of the final one (the foreground reply's) and grows from poll to poll. The core is
    held (SIGSTOP) and let run 5 ms at a time, each GET 0.1 s into a hold, so that many polls
    land before the end whatever the machine's speed. Ends as the foreground reply."""
    oracle = whole(server, **BODY, max_output_tokens=60)
    core = core_pid(server.proc.pid)
    partial, final = [], None
    os.kill(core, signal.SIGSTOP)
    try:
        reply = background(server, **BODY, max_output_tokens=60)
        for _ in range(2000):
            os.kill(core, signal.SIGCONT)
            time.sleep(0.005)
            os.kill(core, signal.SIGSTOP)
            time.sleep(0.1)  # the API process takes in what the core sent
            body = get(server, reply["id"]).json()
            Response.model_validate(body)
            if body["status"] in TERMINAL:
                final = body
                break
            if output_text(body):
                assert body["status"] == "in_progress"
                assert [(i["type"], i["status"]) for i in body["output"]] == \
                    [("message", "in_progress")], body["output"]
                partial.append(output_text(body))
    finally:
        os.kill(core, signal.SIGCONT)
    assert final is not None and output_text(final) == output_text(oracle)
    assert len(set(partial)) >= 2, partial  # seen growing
    for before, after in itertools.pairwise(partial):
        assert after.startswith(before)
    assert all(output_text(oracle).startswith(p) for p in partial)


# ---- streaming and resuming ----------------------------------------------------------------------
def test_background_stream_resumes_after_a_sequence_number(server):
    """background + stream: the events as in the foreground (created ``queued``); a client
    that leaves after 3 deltas does not stop the run; GET ?stream=true&starting_after=N gives
    the events after N, through the end, whose text completes the foreground reply's;
    without starting_after every event again."""
    oracle = whole(server, **BODY, max_output_tokens=40)
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json={
            "model": MODEL, **BODY, "max_output_tokens": 40, "background": True,
            "stream": True}) as resp:
        assert resp.status_code == 200
        first = sse_events(resp, stop_after_deltas=3)
    assert first[0]["type"] == "response.created"
    assert first[0]["response"]["status"] == "queued"
    response_id, last = first[0]["response"]["id"], first[-1]["sequence_number"]
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    with httpx.stream("GET", f"{server.url}/v1/responses/{response_id}", timeout=60,
                      params={"stream": "true", "starting_after": last}) as resp:
        assert resp.status_code == 200
        rest = sse_events(resp)
    assert [e["sequence_number"] for e in rest] == \
        list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1]["type"] == f"response.{oracle['status']}"
    assert delta_text(first) + delta_text(rest) == output_text(oracle)
    assert output_text(rest[-1]["response"]) == output_text(oracle)
    by_client = server.client().responses.retrieve(response_id, stream=True,
                                                   starting_after=last)
    assert [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in by_client] == \
        [(e["type"], e["sequence_number"], e.get("delta")) for e in rest]  # the client's call
    with httpx.stream("GET", f"{server.url}/v1/responses/{response_id}", timeout=60,
                      params={"stream": "true"}) as resp:
        again = sse_events(resp)
    assert [e["type"] for e in again] == [e["type"] for e in first + rest]
    assert delta_text(again) == output_text(oracle)
    assert poll(server, response_id)[-1]["status"] == oracle["status"]


# ---- cancel ------------------------------------------------------------------------------------
def test_cancel_a_queued_response_frees_its_blocks(server, free_at_start):
    """Cancelled before the engine ran a step of it: ``cancelled``, again on a second cancel
    and on GET (never overwritten once the core goes on), and every KV block free again."""
    with core_held(server):
        reply = background(server, **BODY, max_output_tokens=200)
        assert get(server, reply["id"]).json()["status"] in ("queued", "in_progress")
        resp = cancel(server, reply["id"])
        assert resp.status_code == 200, resp.text
        Response.model_validate(resp.json())
        assert (resp.json()["id"], resp.json()["status"]) == (reply["id"], "cancelled")
        assert cancel(server, reply["id"]).json() == resp.json()  # idempotent
    assert_no_leak(server, free_at_start)
    assert get(server, reply["id"]).json() == resp.json()


def test_cancel_mid_run_stops_generation(server, free_at_start):
    """Cancelled while generating (after 2 streamed deltas, the core then held): status
    ``cancelled``, fewer tokens generated than the 200 asked (the oracle runs all 200), the
    request counted as aborted, every KV block free again; a resumed stream ends. The
    cancelled response keeps the text generated until then (OpenAI's rule): the streamed
    deltas' text, a non-empty proper prefix of the foreground greedy reply's, its message
    ``incomplete``, its usage the prompt's and the generated tokens (bounded by the deltas
    and the engine's count, the foreground reply cut there starting with that text); a
    reply continuing it sees that text as the assistant's turn."""
    oracle = whole(server, **BODY, max_output_tokens=200)
    assert oracle["status"] == "incomplete"  # it would run all 200
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json={
            "model": MODEL, **BODY, "max_output_tokens": 200, "background": True,
            "stream": True}) as resp:
        first = sse_events(resp, stop_after_deltas=2)
    response_id = first[0]["response"]["id"]
    with core_held(server):
        assert get(server, response_id).json()["status"] == "in_progress"
        resp = cancel(server, response_id)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled", resp.text
    kept = resp.json()
    assert_no_leak(server, free_at_start)
    after = server.metrics()

    def grew(name, **labels):
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:request_success_total", finished_reason="abort") == 1
    assert grew("kvflow:generation_tokens_total") < 200
    assert get(server, response_id).json()["status"] == "cancelled"
    with httpx.stream("GET", f"{server.url}/v1/responses/{response_id}", timeout=30,
                      params={"stream": "true"}) as resp:
        replay = sse_events(resp)  # ends: the log is closed
    assert replay[:len(first)] == first
    assert delta_text(replay) == output_text(oracle)[:len(delta_text(replay))]
    assert output_text(kept) == delta_text(replay)
    assert 0 < len(output_text(kept)) < len(output_text(oracle))
    assert output_text(oracle).startswith(output_text(kept))
    assert [(i["type"], i["status"]) for i in kept["output"]] == [("message", "incomplete")]
    assert get(server, response_id).json() == kept
    # usage counts the prompt (the oracle's count) and the tokens generated until the cancel:
    # at least one per streamed text delta, at most what the engine generated for it
    # (the metric), and the greedy foreground reply cut at that many tokens starts with the
    # kept text (its end may add the text of bytes the stream still held back)
    usage, num_kept = kept["usage"], kept["usage"]["output_tokens"]
    num_deltas = sum(e["type"] == "response.output_text.delta" for e in replay)
    assert num_deltas <= num_kept <= grew("kvflow:generation_tokens_total")
    assert (usage["input_tokens"], usage["total_tokens"]) == \
        (oracle["usage"]["input_tokens"], oracle["usage"]["input_tokens"] + num_kept)
    cut = whole(server, **BODY, max_output_tokens=num_kept)
    assert cut["usage"]["output_tokens"] == num_kept
    assert output_text(cut).startswith(output_text(kept))
    # the continuation sees the kept text as the assistant's turn, as chat does; how much was
    # kept depends on how far the core ran before it was held, so both may exceed the
    # server's 256-token context: then both are refused alike
    follow = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "and then", "previous_response_id": response_id,
        "max_output_tokens": 1})
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": BODY["input"]},
            {"role": "assistant", "content": output_text(kept)},
            {"role": "user", "content": "and then"}]})
    assert follow.status_code == chat.status_code, (follow.text, chat.text)
    if follow.status_code != 200:
        assert follow.status_code == 400 and "context" in follow.text, follow.text
        return
    no_turn = whole(server, input="and then", max_output_tokens=1)
    assert follow.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"] > \
        no_turn["usage"]["input_tokens"]


def test_delete_a_running_response_cancels_it(server, free_at_start):
    with core_held(server):
        reply = background(server, **BODY, max_output_tokens=200)
        resp = httpx.delete(f"{server.url}/v1/responses/{reply['id']}", timeout=30)
        assert resp.status_code == 200
        assert resp.json() == {"id": reply["id"], "object": "response.deleted",
                               "deleted": True}
        assert get(server, reply["id"]).status_code == 404
    assert_no_leak(server, free_at_start)


def test_running_responses_are_bounded_and_never_dropped(server, free_at_start):
    """At most STORE_SIZE run at once: one more is a 429 naming ``background`` (nothing of
    it queued); a running one is not dropped from the store by newer replies, and a reply
    naming it as previous_response_id is a 400 until it ends."""
    with core_held(server):
        running = [background(server, **BODY, max_output_tokens=200)
                   for _ in range(STORE_SIZE)]
        resp = respond(server, **BODY, background=True)
        assert resp.status_code == 429, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("background", "too_many_background_responses")
        assert resp.headers["retry-after"] == "1"
        resp = respond(server, input="hi", previous_response_id=running[0]["id"])
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "previous_response_id"
        for reply in running:
            assert cancel(server, reply["id"]).json()["status"] == "cancelled"
    assert_no_leak(server, free_at_start)
    for _ in range(STORE_SIZE):  # newer replies push the ended ones out, as any reply
        whole(server, input="hi", max_output_tokens=2)
    assert all(get(server, r["id"]).status_code == 404 for r in running)


# ---- request_id ------------------------------------------------------------------------------------
def test_request_id_names_the_response_and_a_running_one_keeps_it(server, free_at_start):
    """vLLM 0.32's ``request_id`` is the response's id as sent: GET and cancel name it. While
    a background response of that id runs, another request sending it (background or not)
    is a 400 naming ``request_id`` and queues nothing; once it ended, a request sending it
    replaces the stored reply (vLLM's store is a dict by id): GET then shows the new one,
    the foreground greedy reply of the same body, and ``previous_response_id`` continues
    it; a background streamed one's events are not the new reply's (no stream to resume)."""
    oracle = whole(server, **BODY, max_output_tokens=6)
    with core_held(server):
        reply = background(server, **BODY, max_output_tokens=200, request_id="job-1")
        assert reply["id"] == "job-1" and get(server, "job-1").json()["background"]
        for again in ({"background": True}, {}, {"stream": True}):
            resp = respond(server, **BODY, request_id="job-1", **again)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["param"], error["code"]) == ("request_id", "invalid_value"), error
        assert cancel(server, "job-1").json()["status"] == "cancelled"
    assert_no_leak(server, free_at_start)
    replaced = whole(server, **BODY, max_output_tokens=6, request_id="job-1")
    assert (replaced["id"], replaced["background"]) == ("job-1", False)
    assert output_text(replaced) == output_text(oracle) and output_text(oracle)
    assert get(server, "job-1").json() == replaced
    follow = whole(server, input="and then", previous_response_id="job-1",
                   max_output_tokens=2)
    assert follow["previous_response_id"] == "job-1"
    assert follow["usage"]["input_tokens"] > replaced["usage"]["input_tokens"]
    # a background streamed one replaced by a foreground one: no stream left to resume
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json={
            "model": MODEL, **BODY, "max_output_tokens": 4, "background": True,
            "stream": True, "request_id": "job-2"}) as resp:
        assert sse_events(resp)[-1]["response"]["id"] == "job-2"
    poll(server, "job-2")
    assert get(server, "job-2", stream="true").status_code == 200
    whole(server, **BODY, max_output_tokens=2, request_id="job-2")
    resp = get(server, "job-2", stream="true")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream", resp.text


# ---- bad combinations ----------------------------------------------------------------------------
BAD = [
    ({"background": True, "store": False}, "background"),
    ({"background": "yes"}, "background"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[str(b) for b, _ in BAD])
def test_bad_background_request_is_a_400_naming_the_field(server, body, param):
    resp = respond(server, input="hi", **body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize(("params", "param"), [
    ({"stream": "true"}, "stream"),  # a foreground reply has no stream to resume
    ({"starting_after": "3"}, "starting_after"),  # needs stream=true
    ({"stream": "true", "starting_after": "x"}, "starting_after"),
    ({"stream": "maybe"}, "stream"),
    ({"include": "x"}, "include"),
])
def test_bad_stream_resume_is_a_400_naming_the_parameter(server, params, param):
    reply = whole(server, input="hi", max_output_tokens=2)
    resp = get(server, reply["id"], **params)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


# ---- shutdown (last: it stops this module's server) ----------------------------------------------
def test_shutdown_fails_a_running_response_and_exits(server):
    """SIGTERM while a background response generates (2 deltas streamed of the 200 asked;
    the engine core held meanwhile, so the run cannot finish first on a fast machine): its
    stream ends with ``response.failed`` (``server_error``, the shutdown's message), and the
    server exits within seconds (nothing waits on the run)."""
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60, json={
            "model": MODEL, **BODY, "max_output_tokens": 200, "background": True,
            "stream": True}) as resp:
        lines = resp.iter_lines()
        first = sse_events(resp, stop_after_deltas=2, lines=lines)
        with core_held(server):
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
        rest = sse_events(resp, lines=lines)
    assert first[0]["response"]["status"] == "queued"
    assert rest[-1]["type"] == "response.failed", rest[-1]
    error = rest[-1]["response"]["error"]
    assert error["code"] == "server_error" and "shutting down" in error["message"]
    assert server.proc.wait(20) is not None
