"""A ``kvflow serve`` started with vLLM's server flags (README "Coming from vLLM"), each
checked by its effect: ``--response-role`` in replies whole and streamed,
``--default-chat-template-kwargs`` in the rendered prompt (a template that prints the
variable; the request's own value wins), ``--enable-force-include-usage`` (a usage chunk no
request asked for, equal to the whole reply's usage), ``--root-path`` (the OpenAPI schema's
server; routes stay where they are, as the proxy strips the prefix), ``--enable-log-requests`` with
``--max-log-len`` (the log line, its prompt cut), and ``--enable-auto-tool-choice`` (accepted:
tool_choice auto is served); engine flags accepted at start-up, and
``--override-generation-config`` as the default max_tokens. The HTTP-only flags are tested without a model in
tests/test_vllm_server_flags.py."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL, ALIAS = "tiny", "tiny-alias"
GREETING = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}{% if tools %}T{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "128",
        "--block-size", "4", "--enable-chunked-prefill", "--trust-remote-code",
        "--override-generation-config", json.dumps({"max_new_tokens": 3}),
        "--max-model-len", "96", "--served-model-name", MODEL, ALIAS, "--chat-template", GREETING,
        "--default-chat-template-kwargs", json.dumps({"greeting": "hello",
                                                      "enable_thinking": False}),
        "--response-role", "bot", "--enable-force-include-usage", "--root-path", "/llm",
        "--enable-log-requests", "--max-log-len", "4", "--uvicorn-log-level", "info",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
HI = [{"role": "user", "content": "hi"}]


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def rendered(server, **extra) -> str:
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": HI, **extra},
                     timeout=30).json()["tokens"]
    return httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": ids},
                      timeout=30).json()["prompt"]


def test_default_template_kwargs_in_the_prompt(server):
    assert rendered(server) == "[hello]<user>hi\n<assistant>"
    assert rendered(server, chat_template_kwargs={"greeting": "yo"}) == \
        "[yo]<user>hi\n<assistant>"


def test_response_role_and_forced_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "bot"
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "bot"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    text = list(client.completions.create(model=MODEL, prompt="the quick", max_tokens=2,
                                          stream=True, extra_body={"ignore_eos": True}))
    assert text[-1].usage.completion_tokens == 2 and text[-1].choices == []


def test_root_path(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert schema["servers"] == [{"url": "/llm"}]
    # the proxy strips the prefix: routes stay where they are
    response = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL


def test_served_model_name_aliases(client, server):
    """``--served-model-name tiny tiny-alias``: both names serve the base model (the same
    greedy tokens, each echoed as the reply's model), /v1/models lists both, another name
    is a 404 listing them."""
    ids = {}
    for name in (MODEL, ALIAS):
        reply = client.completions.create(model=name, prompt="the quick", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
        assert reply.model == name
        ids[name] = reply.choices[0].token_ids
    assert ids[MODEL] == ids[ALIAS] and len(ids[MODEL]) == 3
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, ALIAS]
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                      json={"model": "other", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 404 and "['tiny', 'tiny-alias']" in resp.json()["error"]["message"]


def test_tool_choice_auto_served(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, tools=tools,
                                           tool_choice="auto")
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_request_logged_with_prompt_cut(client, server):
    client.completions.create(model=MODEL, prompt="zebra crossing", max_tokens=1)
    lines = [line for line in server.log().splitlines() if "received request cmpl-" in line]
    assert any("prompt: 'zebr'," in line for line in lines), lines


def test_beam_search_logged_with_its_params(client, server):
    client.completions.create(model=MODEL, prompt="yak herding", max_tokens=2, n=2,
                              extra_body={"use_beam_search": True})
    lines = [line for line in server.log().splitlines() if "received request cmpl-" in line
             and "prompt: 'yak '," in line]
    assert len(lines) == 1 and "params: BeamSearchParams(beam_width=2" in lines[0], lines


def test_override_generation_config_sets_the_default_max_tokens(client):
    reply = client.completions.create(model=MODEL, prompt="the quick",
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
