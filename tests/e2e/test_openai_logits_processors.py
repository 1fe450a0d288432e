"""Custom logits processors served (``kvflow serve --logits-processors``, the tiny Llama):
``vllm_xargs`` reaches them as ``SamplingParams.extra_args`` on /v1/completions and
/v1/chat/completions; a value a processor's ``validate_params`` refuses, a nested value, and
``vllm_xargs`` with beam search are 400s naming the field; the per-request
``logits_processors`` field is a 400 pointing at the flag. Oracles: a plain torch loop over
transformers' logits with the same ban / forced tokens (tests/test_logits_processors.py), and
the request without ``vllm_xargs``. A per-request processor that raises for one request
(``FailAt``, tests/test_step_fault_isolation.py) is that request's 400 naming ``vllm_xargs``
(a 500 for an exception other than ValueError); the request beside it gets its tokens.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.test_logits_processors import _reference

PROCS = "tests.test_logits_processors"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
        "--max-num-seqs", "4", "--logits-processors", f"{PROCS}:BanToken",
        f"{PROCS}:ForceEvery", "tests.test_step_fault_isolation:FailAt"]
C, CH = "/v1/completions", "/v1/chat/completions"
STEPS = 6


def prestart_servers(fixture):
    """This module's server, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, request):
    return start_server.declared(request)


def post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    base = {"temperature": 0, "max_tokens": STEPS, "ignore_eos": True,
            "return_token_ids": True}
    base.update({"prompt": [5, 6, 7, 8]} if path == C else
                {"messages": [{"role": "user", "content": "hi"}]})
    return httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=60)


def tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_vllm_xargs_reach_the_processors(server, tiny_llama):
    prompt = [5, 6, 7, 8]
    plain = _reference(tiny_llama.hf_model, prompt, STEPS)
    assert tokens(post(server, C, {})) == plain
    ban = plain[0]
    assert tokens(post(server, C, {"vllm_xargs": {"ban_token": ban}})) == \
        _reference(tiny_llama.hf_model, prompt, STEPS, ban=ban)
    xargs = {"ban_token": ban, "force_token": 40, "every": 2}
    assert tokens(post(server, C, {"vllm_xargs": xargs})) == \
        _reference(tiny_llama.hf_model, prompt, STEPS, ban=ban, force=(40, 2))


def test_chat_takes_vllm_xargs_too(server):
    out = tokens(post(server, CH, {"vllm_xargs": {"force_token": 41, "every": 1}}))
    assert out == [41] * STEPS


@pytest.mark.parametrize("path", [C, CH])
def test_refused_vllm_xargs_are_400s_naming_the_field(server, path):
    refused = error(post(server, path, {"vllm_xargs": {"ban_token": "x"}}))
    assert "ban_token='x' must be a token id" in refused["message"], refused
    nested = error(post(server, path, {"vllm_xargs": {"ban_token": {"id": 3}}}))
    assert nested["param"] == "vllm_xargs.ban_token", nested
    beam = error(post(server, path, {"vllm_xargs": {"ban_token": 3}, "use_beam_search": True,
                                     "n": 2}))
    assert beam["param"] == "vllm_xargs", beam
    per_request = error(post(server, path, {"logits_processors": ["x"]}))
    assert (per_request["param"], per_request["code"]) == \
        ("logits_processors", "unsupported_parameter")
    assert "--logits-processors module.path:ClassName" in per_request["message"]


def test_responses_take_vllm_xargs_as_chat_does(server):
    """/v1/responses passes ``vllm_xargs`` to the processors: the reply's text is chat's for
    the same conversation and arguments (every token forced to 41), not the plain reply's;
    a value a processor refuses or a nested one is a 400 naming the field."""
    xargs = {"force_token": 41, "every": 1}
    chat = post(server, CH, {"vllm_xargs": xargs, "ignore_eos": False})
    assert tokens(chat) == [41] * STEPS
    body = {"input": "hi", "temperature": 0, "max_output_tokens": STEPS}

    def respond(extra: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/responses", json={**body, **extra}, timeout=60)

    forced, plain = respond({"vllm_xargs": xargs}), respond({})
    assert forced.status_code == plain.status_code == 200, (forced.text, plain.text)
    text = forced.json()["output"][0]["content"][0]["text"]
    assert text == chat.json()["choices"][0]["message"]["content"]
    assert text != plain.json()["output"][0]["content"][0]["text"]
    refused = error(respond({"vllm_xargs": {"ban_token": "x"}}))
    assert "ban_token='x' must be a token id" in refused["message"], refused
    nested = error(respond({"vllm_xargs": {"ban_token": {"id": 3}}}))
    assert nested["param"] == "vllm_xargs.ban_token", nested


def test_a_processor_failing_on_one_request_is_that_requests_error_alone(server, tiny_llama):
    """Was: the exception ended the engine core's step, so the core (every open request
    failed, then 503s)."""
    from concurrent.futures import ThreadPoolExecutor

    plain = _reference(tiny_llama.hf_model, [5, 6, 7, 8], STEPS)
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, server, C, {"vllm_xargs": {"fail_at": 2}})
        good = pool.submit(post, server, C, {})
        bad, good = bad.result(), good.result()
    refused = error(bad)
    assert refused["param"] == "vllm_xargs", refused
    assert "its logits processor: fail_at=2 reached" in refused["message"], refused
    assert tokens(good) == plain
    failed = post(server, CH, {"vllm_xargs": {"fail_at": 1, "kind": "runtime"}})
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == "internal_error"
    assert tokens(post(server, C, {})) == plain  # the engine serves on
