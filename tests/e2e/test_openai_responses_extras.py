"""/v1/responses beyond the reply itself, end to end on the tiny random model (the template
of test_openai_responses): output logprobs (oracle: chat's ``logprobs.content`` for the same
greedy request; the openai package's types parse every body and event). Bad values are a 400
naming the field."""

from __future__ import annotations

import pytest

from tests.e2e.test_openai_responses import (
    SERVER_ARGS,
    TOOLS,
    chat,
    output_text,
    respond,
    responses_model,
    streamed,
    whole,
)

LOGPROBS = ["message.output_text.logprobs"]


def prestart_servers(fixture):
    return [(responses_model(fixture("tiny_llama"), fixture("built_models")), SERVER_ARGS,
             None)]


def event_form(entries: list[dict]) -> list[dict]:
    """Chat's logprobs entries in the stream events' form (no ``bytes``; hand-written)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


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
    assert part["logprobs"] == expected
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
    assert reply["top_logprobs"] == top
    events = streamed(server, include=LOGPROBS, **body, **extra)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    sent = [entry for e in deltas for entry in e["logprobs"]]
    assert sent == event_form(expected)[:len(sent)] and sent
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == event_form(expected)
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected


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
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in logprobs] == \
        [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
         for e in oracle["choices"][0]["logprobs"]["content"]]


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
