"""Top-level request fields kvflow does not declare, served (``kvflow serve`` with the tiny
Llama): by default a 400 naming every one of them (code ``unknown_parameter``, as the OpenAI
API answers "Unrecognized request argument supplied"), on every endpoint with a JSON body,
after which the server still serves and holds no KV block; with ``--ignore-unknown-fields``
the same request is answered as if the field were not there and the name is logged once for
the whole server (vLLM's behaviour). The fields real OpenAI and vLLM clients send are accepted
with the reply they ask for (each declared field is also walked on its own in
tests/e2e/test_openai_fields.py, embeddings' included). Oracles: the request without the field (greedy ids), the
``max_tokens`` sent (reply length), the free-block count as the module starts.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.e2e.test_openai_limits import ARGS as IGNORING_ARGS
from tests.e2e.test_openai_limits import AUTH
from tests.e2e.test_openai_limits import ENV as IGNORING_ENV
from tests.e2e.test_openai_ops_routes import ARGS as STRICT_ARGS
from tests.e2e.test_openai_ops_routes import ENV as STRICT_ENV
from tests.e2e.test_openai_ops_routes import NUM_KV_BLOCKS

# Both servers are shared for the session, and nothing here reads what another module's
# requests leave. The strict (default) one is test_openai_ops_routes.py's (its ENV serves
# the LoRA load/unload routes; the free-block count is read when this module starts and every
# request ends back there). The --ignore-unknown-fields one (info logs) is
# test_openai_limits.py's: it wants an API key (``AUTH``, sent to both: the strict server has
# no key and reads no such header) and runs one request at a time (this module sends one at
# a time); the names its log is searched for are sent by no other module.
C, CH, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
R = "/v1/responses"
TOK, DETOK = "/tokenize", "/detokenize"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
HI = [{"role": "user", "content": "hi"}]
BASE = {C: {"prompt": "the quick brown fox", "temperature": 0, "return_token_ids": True},
        CH: {"messages": HI, "temperature": 0, "return_token_ids": True},
        R: {"input": "hi", "temperature": 0, "max_output_tokens": 4},
        EMB: {"input": "hi"}, TOK: {"prompt": "hi"}, DETOK: {"tokens": [5, 6]},
        LOAD: {"lora_name": "a", "lora_path": "/nowhere"}, UNLOAD: {"lora_name": "a"}}


@pytest.fixture(scope="module")
def servers(start_server, tiny_chat_model):
    """(the session's strict server, the session's ignoring server). The module declares
    no ``prestart_servers``: declaring a shared server would start a second one ahead while
    the module before it that shares it has not taken it yet. Either one not started yet
    starts now, side by side with the other."""
    start_server.prestart(tiny_chat_model, IGNORING_ARGS, IGNORING_ENV)
    return (start_server.shared(tiny_chat_model, STRICT_ARGS, STRICT_ENV),
            start_server.shared(tiny_chat_model, IGNORING_ARGS, IGNORING_ENV))


@pytest.fixture(scope="module")
def strict(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ignoring(servers):
    return servers[1]


@pytest.fixture(scope="module")
def free_at_start(strict) -> float:
    """The strict server's free KV blocks before this module's first generation request
    (the shared server is idle between modules: every block free)."""
    return strict.value(strict.metrics(), "kvflow:kv_cache_free_blocks")


def post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={**BASE[path], **body}, headers=AUTH,
                      timeout=60)


def ok(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_ids(reply: dict[str, Any]) -> list[int]:
    return reply["choices"][0]["token_ids"]


def unknown_error(resp: httpx.Response) -> dict[str, Any]:
    """The OpenAI error body of a 400 for unknown fields."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_parameter")
    return error


@pytest.mark.parametrize("path", [C, CH])
def test_misspelled_max_tokens_is_a_400_naming_it(strict, path):
    """``max_token`` (for ``max_tokens``) was ignored: a 200 with a reply of the default
    length. Now it is refused, naming the field; spelled right, it is honoured."""
    error = unknown_error(post(strict, path, {"max_token": 3}))
    assert error["param"] == "max_token" and "max_token" in error["message"]
    reply = ok(strict, path, {"max_tokens": 3, "ignore_eos": True})
    assert len(token_ids(reply)) == 3 and reply["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", [C, CH])
def test_every_unknown_field_is_named(strict, path):
    error = unknown_error(post(strict, path, {"temprature": 0.5, "max_token": 3}))
    assert error["param"] == "max_token"  # the first, sorted
    assert "max_token" in error["message"] and "temprature" in error["message"]


@pytest.mark.parametrize("path", [R, EMB, TOK, DETOK, LOAD, UNLOAD])
def test_every_json_endpoint_refuses_unknown_fields(strict, path):
    """Before anything else (this text model would refuse /v1/embeddings for its task, and
    the adapter for its path, after)."""
    assert unknown_error(post(strict, path, {"frobnicate": 1}))["param"] == "frobnicate"


def test_unsupported_fields_keep_their_code(strict):
    resp = post(strict, CH, {"logits_processors": ["x"], "max_token": 3})
    error = resp.json()["error"]
    assert resp.status_code == 400 and (error["param"], error["code"]) == \
        ("logits_processors", "unsupported_parameter"), resp.text


def test_the_server_still_serves_and_holds_no_block_after_the_400s(strict, free_at_start):
    for path in (C, CH):
        for _ in range(3):
            unknown_error(post(strict, path, {"max_token": 3, "stream": True}))
    reply = ok(strict, C, {"max_tokens": 5, "ignore_eos": True})
    assert reply["usage"]["completion_tokens"] == 5
    deadline = time.monotonic() + 10
    while (free := strict.value(strict.metrics(), "kvflow:kv_cache_free_blocks")) \
            != free_at_start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free == free_at_start == NUM_KV_BLOCKS - 1  # block 0 is the null block


def test_ignore_option_answers_as_without_the_field_and_logs_it_once(ignoring):
    """Under --ignore-unknown-fields ``max_token`` is ignored: the reply is the one without
    it (the default length, 16 for completions, not 3), and the name is logged once however
    many requests and endpoints send it."""
    plain = ok(ignoring, C, {"ignore_eos": True})
    for _ in range(3):
        reply = ok(ignoring, C, {"ignore_eos": True, "max_token_z9": 3})
        assert token_ids(reply) == token_ids(plain) and len(token_ids(reply)) == 16
    ok(ignoring, CH, {"max_tokens": 2, "max_token_z9": 3})
    for path in (EMB, TOK, DETOK):  # the name is ignored on every endpoint before the rest
        resp = post(ignoring, path, {"max_token_z9": 3})
        assert resp.status_code != 400 or resp.json()["error"]["param"] != "max_token_z9"
    ok(ignoring, DETOK, {"frobnicate_y8": 1})
    log = ignoring.log_path.read_text(errors="replace")
    assert (log.count("max_token_z9"), log.count("frobnicate_y8")) == (1, 1), log
    assert "ignoring request fields" in log


def test_ignore_option_answers_responses_as_without_the_field(strict, ignoring):
    """/v1/responses under --ignore-unknown-fields: ``n`` (not a Responses API field, nor
    vLLM 0.32's) is ignored, the reply's text is the one without it; ``reasoning.effort`` (chat's
    ``reasoning_effort``), which the tiny model's template does not read, is a 400 naming it
    by default and dropped under the option (vLLM drops it), the reply the one without it."""
    def same_output(reply):
        return reply["output"] == [{**item, "id": reply["output"][i]["id"]}
                                   for i, item in enumerate(plain["output"])]
    plain = ok(ignoring, R, {})
    assert same_output(ok(ignoring, R, {"n": 2}))
    effort = {"reasoning": {"effort": "low"}}
    resp = post(strict, R, effort)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "reasoning.effort"
    assert same_output(ok(ignoring, R, effort))


def test_ignore_option_drops_unread_chat_template_kwargs(strict, ignoring):
    """A chat_template_kwargs key the template never reads (``enable_thinking`` for a model
    without that switch): a 400 naming it by default; under --ignore-unknown-fields dropped:
    the chat reply is the one without it (greedy ids), /tokenize renders the same prompt, and
    the key is logged once."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = post(strict, CH, {"max_tokens": 3, **kwargs})
    assert (resp.status_code, resp.json()["error"]["param"]) == \
        (400, "chat_template_kwargs.enable_thinking")
    plain = ok(ignoring, CH, {"max_tokens": 3})
    for _ in range(2):
        assert token_ids(ok(ignoring, CH, {"max_tokens": 3, **kwargs})) == token_ids(plain)

    def tokenize(body):
        resp = httpx.post(f"{ignoring.url}{TOK}", json={"messages": HI, **body},
                          headers=AUTH, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]
    assert tokenize(kwargs) == tokenize({})
    log = ignoring.log_path.read_text(errors="replace")
    assert log.count("chat_template_kwargs.enable_thinking") == 1, log


def test_ignore_option_still_refuses_unsupported_fields(ignoring):
    resp = post(ignoring, CH, {"logits_processors": ["x"]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_parameter"


# Fields OpenAI's and vLLM's clients send, with values that ask for the plain greedy reply.
CLIENT_FIELDS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                 "prompt_cache_key": "conv-1", "safety_identifier": "sid-1", "seed": 7, "n": 1,
                 "logit_bias": {}, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                 "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "include_stop_str_in_output": False, "ignore_eos": True, "min_tokens": 0,
                 "priority": 0, "request_id": None}


@pytest.mark.parametrize("path,extra", [
    (CH, {**CLIENT_FIELDS, "parallel_tool_calls": True, "logprobs": True, "top_logprobs": 1}),
    (C, {k: v for k, v in CLIENT_FIELDS.items() if k not in (
        "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")}
     | {"echo": False}),
])
def test_fields_real_clients_send_are_accepted(strict, path, extra):
    """The same greedy ids as without them, and the length max_tokens asks for."""
    plain = ok(strict, path, {"max_tokens": 6, "ignore_eos": True})
    reply = ok(strict, path, {"max_tokens": 6, **extra})
    assert token_ids(reply) == token_ids(plain) and len(token_ids(reply)) == 6
    streamed = post(strict, path, {"max_tokens": 6, **extra, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"completion_tokens":6' in \
        streamed.text.replace(" ", ""), streamed.text



def test_store_true_is_refused_on_completions_even_when_ignoring(ignoring):
    """Chat refuses ``store: true`` (kvflow keeps no completions); completions have no
    ``store`` in OpenAI's API, and --ignore-unknown-fields used to drop it there and answer
    200 (embeddings: tests/test_unknown_fields.py; this server's model generates).
    ``store: false`` and ``service_tier: "default"`` ask for nothing and pass."""
    for body, param in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier")):
        resp = post(ignoring, C, {"max_tokens": 2, **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    reply = ok(ignoring, C, {"max_tokens": 2, "ignore_eos": True, "store": False,
                             "service_tier": "default"})
    assert reply["usage"]["completion_tokens"] == 2
