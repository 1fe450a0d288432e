"""Sleep mode over HTTP (``KVFLOW_SERVER_DEV_MODE=1 kvflow serve --enable-sleep-mode``):
/sleep, /wake_up, /is_sleeping and /collective_rpc through the engine-core process. Greedy
completions after each wake-up equal the ones before the sleep and transformers' greedy
decoding; requests are answered 503 (``engine_sleeping``) while asleep; a sleep with a request
in flight is a 400."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI

from kvflow.entrypoints.sleep_routes import add_sleep_routes
from tests.e2e.test_engine_faults import ARGS, core_pid

PROMPT = [5, 9, 23, 41, 7, 77, 120, 3, 64, 200, 11, 12]  # whole blocks of 4: prefix-cached
MAX_TOKENS = 8


def prestart_servers(fixture):
    """This module's server, taken by conftest.py's ``server`` fixture and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_llama").path, [*ARGS, "--enable-sleep-mode"],
             {"KVFLOW_SERVER_DEV_MODE": "1"})]


def _complete(server, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _text(server) -> str:
    resp = _complete(server)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _hf_text(tiny) -> str:
    from transformers import AutoTokenizer

    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([PROMPT]), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                     pad_token_id=0)
    return AutoTokenizer.from_pretrained(tiny.path).decode(out[0, len(PROMPT):])


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def _sleeping(server) -> bool:
    return httpx.get(f"{server.url}/is_sleeping", timeout=10).json()["is_sleeping"]


def _assert_refused_asleep(server, words: str) -> None:
    resp = _complete(server)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "engine_sleeping" and words in error["message"], error


def _sleep_state(server) -> dict[str, float]:
    """vLLM's ``engine_sleep_state`` series on /metrics, by ``sleep_state`` label."""
    metrics = server.metrics()
    return {state: server.value(metrics, "kvflow:engine_sleep_state", sleep_state=state)
            for state in ("awake", "weights_offloaded", "discard_all")}


def test_level_1_sleep_and_wake_up(server, tiny_llama):
    """/metrics' ``kvflow:engine_sleep_state`` follows, as vLLM's: awake, weights offloaded
    while asleep at level 1 (half woken too), awake again once both tags woke."""
    expected = _hf_text(tiny_llama)
    assert not _sleeping(server) and _text(server) == expected
    awake = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert _sleep_state(server) == awake
    resp = _post(server, "/sleep?level=1")  # vLLM 0.32's bodies (they were empty)
    assert (resp.status_code, resp.json()) == (200, {"status": "sleeping", "level": 1})
    assert _sleeping(server)
    assert _sleep_state(server) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    _assert_refused_asleep(server, "wake_up")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert _post(server, "/sleep").status_code == 200  # asleep already: a no-op
    kv = _post(server, "/collective_rpc", json={"method": "kv_cache_bytes"}).json()
    assert kv == {"results": [0]}
    resp = _post(server, "/wake_up?tags=weights")
    assert (resp.status_code, resp.json()) == (200, {"status": "sleeping", "tags": ["weights"]})
    assert _sleeping(server)  # the KV cache still sleeps
    assert _sleep_state(server)["awake"] == 0
    resp = _post(server, "/wake_up?tags=kv_cache")
    assert (resp.status_code, resp.json()) == (200, {"status": "awake", "tags": ["kv_cache"]})
    assert not _sleeping(server)
    assert _sleep_state(server) == awake
    assert _post(server, "/wake_up").status_code == 200  # awake: a no-op
    assert _post(server, "/collective_rpc",
                 json={"method": "kv_cache_bytes"}).json()["results"][0] > 0
    assert _text(server) == expected


def test_level_2_needs_reload_weights(server, tiny_llama):
    expected = _hf_text(tiny_llama)
    resp = _post(server, "/sleep", params={"level": 2})
    assert (resp.status_code, resp.json()) == (200, {"status": "sleeping", "level": 2})
    assert _sleep_state(server) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    resp = _post(server, "/wake_up")
    assert (resp.status_code, resp.json()) == (200, {"status": "awake", "tags": None})
    assert not _sleeping(server)
    _assert_refused_asleep(server, "reload_weights")
    resp = _post(server, "/collective_rpc", json={"method": "reload_weights", "args": []})
    assert resp.status_code == 200 and resp.json() == {"results": [None]}
    assert _text(server) == expected


def test_sleep_with_a_request_in_flight_is_refused(server, tiny_llama):
    expected = _hf_text(tiny_llama)
    started, done = threading.Event(), {}

    def stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=120) as resp:
            for line in resp.iter_lines():
                started.set()
                if line:
                    done["last"] = line

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    core = core_pid(server.proc.pid)
    os.kill(core, signal.SIGSTOP)  # the request stays in flight, however fast the model
    try:
        resp = _post(server, "/sleep")
    finally:
        os.kill(core, signal.SIGCONT)
    thread.join(120)
    assert resp.status_code == 400, resp.text
    assert "in flight" in resp.json()["error"]["message"]
    assert done["last"] == "data: [DONE]" and not _sleeping(server)
    assert _text(server) == expected


def test_a_request_sent_while_the_engine_falls_asleep_is_a_503(server, tiny_llama):
    """The API process refused requests only once every replica answered the sleep: one
    sent meanwhile reached the core after it fell asleep, which refused it as an empty
    ``abort`` that the client got as a 200 with no text."""
    expected = _hf_text(tiny_llama)
    core = core_pid(server.proc.pid)
    answers: dict[str, httpx.Response] = {}
    sent = "sleep(level=1): sent to the engine"
    before = server.log_path.read_text(errors="replace").count(sent)
    os.kill(core, signal.SIGSTOP)  # the sleep call waits for the core: it is under way
    try:
        sleeper = threading.Thread(target=lambda: answers.update(sleep=_post(server, "/sleep")))
        sleeper.start()
        deadline = time.monotonic() + 60
        while server.log_path.read_text(errors="replace").count(sent) == before:
            assert time.monotonic() < deadline, "the server never sent the sleep call"
            time.sleep(0.05)
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}  # refused at once, core or not
        answers["request"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    finally:
        os.kill(core, signal.SIGCONT)
    sleeper.join(60)
    assert answers["sleep"].status_code == 200 and _sleeping(server)
    resp = answers["request"]
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "engine_sleeping" and "going to sleep" in error["message"], error
    _assert_refused_asleep(server, "wake_up")
    assert _post(server, "/wake_up").status_code == 200
    assert _text(server) == expected


@pytest.mark.parametrize(("path", "kwargs", "param", "words"), [
    ("/sleep?level=3", {}, "level", "must be 1"),
    ("/sleep?level=x", {}, "level", "must be 1"),
    ("/wake_up?tags=weights&tags=kv", {}, "tags", "unknown ['kv']"),
    ("/collective_rpc", {"json": {"method": "no_such"}}, "method", "not a Worker method"),
    ("/collective_rpc", {"json": {"args": []}}, "method", "must be a JSON str"),
    ("/collective_rpc", {"json": {"method": "kv_cache_bytes", "timeout": 3}}, "timeout",
     "not supported"),
    ("/collective_rpc", {"json": {"method": "kv_cache_bytes", "x": 1}}, "x", "unknown"),
    ("/collective_rpc", {"json": {"method": "sleep", "args": [1]}}, "method",
     "driven by the engine"),
    ("/collective_rpc", {"json": {"method": "shutdown"}}, "method", "driven by the engine"),
    # an AttributeError in the worker ended the engine core (503 engine_dead for good)
    ("/collective_rpc", {"json": {"method": "determine_available_memory", "args": ["x"]}},
     "method", "determine_available_memory: AttributeError"),
    ("/sleep?levle=2", {}, "levle", "only the query parameter 'level'"),
    ("/sleep?level=1&level=2", {}, "level", "more than once"),
    ("/wake_up?tag=weights", {}, "tag", "only the query parameter 'tags'"),
    # bodies were ignored: a level-1 sleep, both tags woken
    ("/sleep", {"json": {"level": 2}}, "level", "takes no body"),
    ("/wake_up", {"json": {"tags": ["weights"]}}, "tags", "takes no body"),
])
def test_bad_calls_are_400s(server, tiny_llama, path, kwargs, param, words):
    resp = _post(server, path, **kwargs)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert not _sleeping(server)
    assert _text(server) == _hf_text(tiny_llama)  # nothing reached the engine


def test_routes_only_in_dev_mode():
    """Off, each route is a 404 naming KVFLOW_SERVER_DEV_MODE=1 (left out of the schema)."""
    from fastapi.testclient import TestClient

    from kvflow.entrypoints.http_guards import add_error_handlers

    app = FastAPI()
    add_error_handlers(app)
    add_sleep_routes(app, dev_mode=False)
    client = TestClient(app)
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/collective_rpc")):
        resp = client.request(method, path)
        assert resp.status_code == 404, (path, resp.text)
        assert resp.json()["error"]["message"] == \
            f"{method} {path} is served only with KVFLOW_SERVER_DEV_MODE=1"
    assert not {"/sleep", "/wake_up"} & {p for p in app.openapi()["paths"]}
    app = FastAPI()
    add_sleep_routes(app, dev_mode=True)
    assert {"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc"} <= \
        {r.path for r in app.routes}
