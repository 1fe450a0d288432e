"""API key (from KVFLOW_API_KEY) and overload control on the tiny Llama: /v1 routes need the key,
/health and /metrics do not; with one running slot and --max-waiting-requests 1, a third
concurrent request gets 503 with Retry-After (counted on /metrics) and the server keeps
serving. The server is shared with test_unknown_fields_served.py (``--ignore-unknown-fields``
and info logs are its; nothing here sends an unknown field): the overload counts are read as
deltas."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.test_engine_faults import core_pid

API_KEY = "sk-kvflow-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "4",
        "--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-n", "2",
        "--ignore-unknown-fields", "--uvicorn-log-level", "info"]
ENV = {"KVFLOW_API_KEY": API_KEY}


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py) and
    taken with ``start_server.shared``: test_unknown_fields_served.py takes it too."""
    return [(fixture("tiny_chat_model"), ARGS, ENV)]


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """The session's server of ``ARGS`` and ``ENV`` (left running)."""
    return start_server.shared(tiny_chat_model, ARGS, ENV)


def _completion(server, headers=None, **body):
    body = {"prompt": "the quick brown fox", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "no_bearer"])
def test_v1_routes_need_the_key(server, headers):
    for resp in (_completion(server, headers),
                 httpx.get(f"{server.url}/v1/models", headers=headers),
                 httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, headers=headers)):
        assert resp.status_code == 401
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_open_routes_and_the_right_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert _completion(server, AUTH).json()["usage"]["completion_tokens"] >= 1
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235 2.1)
        resp = _completion(server, {"Authorization": f"{scheme} {API_KEY}"})
        assert resp.status_code == 200, resp.text
    assert len(server.client(api_key=API_KEY).models.list().data) == 1
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


def test_n_above_the_configured_cap(server):
    resp = _completion(server, AUTH, n=3)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    assert _completion(server, AUTH, n=2, temperature=1.0).status_code == 200


def test_more_prompts_than_the_waiting_limit_is_a_400(server):
    """Two prompts in one request where --max-waiting-requests is 1: no retry could ever be
    admitted, so it is a 400 naming ``prompt`` (it was a 503 "overloaded: 0 requests are
    waiting" with Retry-After, forever), not counted as an overload; one prompt passes."""
    before = server.value(server.metrics(), "kvflow:requests_overloaded_total")
    resp = _completion(server, AUTH, prompt=["the quick", "brown fox"])
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("prompt", "too_many_prompts")
    assert server.value(server.metrics(), "kvflow:requests_overloaded_total") == before
    assert _completion(server, AUTH, prompt=["the quick"]).status_code == 200


def test_overload_gets_503_with_retry_after(server):
    """Request 1 holds the only running slot, request 2 waits for it, request 3 is refused."""
    long = {"max_tokens": 200, "ignore_eos": True, "stream": True}
    url = f"{server.url}/v1/completions"
    before = server.value(server.metrics(), "kvflow:requests_overloaded_total")
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", url, headers=AUTH,
                        json={"prompt": "the quick brown fox", **long}) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        # The engine core is held stopped while the others come, so request 1 cannot end
        # (and free its slot) before request 3 arrives, however slow a busy machine is.
        core = core_pid(server.proc.pid)
        os.kill(core, signal.SIGSTOP)
        try:
            with http.stream("POST", url, headers=AUTH,
                             json={"prompt": "kvflow pages keys", **long}) as second:
                assert second.status_code == 200  # accepted, waiting for the slot
                third = _completion(server, AUTH)
        finally:
            os.kill(core, signal.SIGCONT)
        assert third.status_code == 503
        assert int(third.headers["Retry-After"]) >= 1
        assert third.json()["error"]["code"] == "server_overloaded"
        overloaded = server.value(server.metrics(), "kvflow:requests_overloaded_total")
        assert overloaded == before + 1  # the only 503 sent since
    # Both clients hung up: the server aborts their requests as it notices (asynchronously).
    # ignore_eos: the request samples (no temperature sent), and an early EOS is no failure.
    deadline = time.monotonic() + 10
    while (resp := _completion(server, AUTH, ignore_eos=True)).status_code == 503 and \
            time.monotonic() < deadline:
        overloaded += 1
        time.sleep(0.1)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert server.value(server.metrics(), "kvflow:requests_overloaded_total") == overloaded
