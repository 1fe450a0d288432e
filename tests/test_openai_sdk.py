"""The official ``openai`` client against the server as its users drive it, through
``build_app`` on a real AsyncLLM over the tiny Llama with a template of its own (the client
over starlette's TestClient: no port, no subprocess).

A reply's message sent back (``messages.append(reply.choices[0].message)``): the client sends
back what it parsed, every key the server wrote (``exclude_unset``), and for
``chat.completions.parse`` / ``.stream`` its own ``parsed`` and ``parsed_arguments``. An empty
``tool_calls`` (which the reply held) was refused as OpenAI refuses one, so the plain round
trip was a 400. Oracle: the reply's JSON read by hand, and the same conversation written as
plain dicts (the rendered prompt, through ``prompt_token_ids``, is the same).

``stream_options`` as the client types it: ``include_obfuscation`` false was a 400 (an
unknown key) on chat and completions, though /v1/responses took it."""

from __future__ import annotations

import shutil
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.serving_client import served_client

USER = {"role": "user", "content": "the quick"}
GREEDY = {"max_tokens": 4, "temperature": 0}
PROMPT_IDS = {"extra_body": {"return_token_ids": True}}


# Counts each message's keys and each call's function's keys (``| length``), so a key the
# client sent back that reached the template shows in the prompt; names ``tools``, so the
# tools reach it (not written as instructions: the random model's context is 256 tokens).
TEMPLATE = ("{% for m in messages %}<{{ m.role }}{{ m | length }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[{{ c.function | length }}{{ c.function.name }}"
            "{{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}"
            "{% if tools %}{{ tools | length }}{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("sdk_roundtrip") / "model"
    shutil.copytree(tiny_llama.path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    with served_client(str(folder)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                            http_client=http)


def test_reply_without_calls_has_no_tool_calls_key(client):
    """A reply that made no tool call leaves ``tool_calls`` out, as OpenAI's does (it was
    ``[]``), so the client's message has it unset."""
    raw = client.chat.completions.with_raw_response.create(model="m", messages=[USER], **GREEDY)
    message = raw.http_response.json()["choices"][0]["message"]
    assert set(message) == {"role", "content"}, message
    assert raw.parse().choices[0].message.model_fields_set == {"role", "content"}


def test_plain_reply_sent_back(client):
    """The client's own message object, sent back, renders as the dict it stands for (it
    was a 400: ``messages.1.tool_calls: at least 1 item, got 0``)."""
    reply = client.chat.completions.create(model="m", messages=[USER], **GREEDY)
    _same_prompt(client, [USER], reply.choices[0].message)


class City(BaseModel):
    city: Literal["Paris", "Rome"]  # a short reply from the random model


def _plain(message) -> dict:
    """The assistant message as the plain dict a client writes by hand (no ``parsed``)."""
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls or []]
    return {"role": "assistant", "content": message.content, **({"tool_calls": calls}
                                                                 if calls else {})}


def _same_prompt(client, history: list, message, after: tuple = (), **request) -> None:
    """``message`` (the client's object) sent back after ``history`` (and before ``after``
    and a new user turn) renders the same prompt as :func:`_plain`'s dict."""
    again = {"role": "user", "content": "fox"}
    typed, plain = (client.chat.completions.create(
        model="m", messages=[*history, m, *after, again], **GREEDY, **PROMPT_IDS, **request)
        for m in (message, _plain(message)))
    assert typed.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]


# the client's own warning, dumping its ParsedChatCompletionMessage (``parsed`` typed None)
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_parsed_reply_sent_back(client):
    """``chat.completions.parse``'s message carries ``parsed`` (the client's reading of the
    JSON content), sent back with it: taken and not rendered (it was a 400 naming
    ``messages.1.parsed`` under SmolLM2's template, and rendered under this one, which
    reads every key)."""
    reply = client.chat.completions.parse(model="m", messages=[USER], response_format=City,
                                          max_tokens=48, temperature=0)
    message = reply.choices[0].message
    assert message.parsed == City.model_validate_json(message.content)
    _same_prompt(client, [USER], message)


TOOL = openai.pydantic_function_tool(City, name="locate")


def test_parsed_tool_calls_sent_back(client):
    """A tool call from ``.parse`` and from ``.stream``'s final completion carries
    ``function.parsed_arguments``, sent back with it: taken and not rendered (it was a 400
    naming ``messages.1.tool_calls.0.function.parsed_arguments``)."""
    forced = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
              "max_tokens": 160, "temperature": 0}
    whole = client.chat.completions.parse(model="m", messages=[USER], **forced)
    with client.chat.completions.stream(model="m", messages=[USER], **forced) as stream:
        streamed = stream.get_final_completion()
    for reply in (whole, streamed):
        message = reply.choices[0].message
        (call,) = message.tool_calls
        assert call.function.parsed_arguments == City.model_validate_json(
            call.function.arguments)
        answer = {"role": "tool", "tool_call_id": call.id, "content": "Paris"}
        _same_prompt(client, [USER], message, (answer,), tools=[TOOL])


def test_parsed_on_another_role_is_refused(client):
    """``parsed`` belongs to assistant turns: on a user turn it is a 400 naming it, not
    dropped unread."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{**USER, "parsed": {"a": 1}}],
                                       **GREEDY)
    assert e.value.param == "messages.0.parsed"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_options_include_obfuscation(client, route):
    """``include_obfuscation: false`` (no padding, what kvflow does anyway) is taken: the
    stream is the one sent without it, usage chunk included; ``true`` is a 400 naming it."""
    def stream(**options) -> list[dict]:
        body = {"model": "m", "stream": True, **GREEDY,
                "stream_options": {"include_usage": True, **options}}
        if route == "chat":
            chunks = client.chat.completions.create(messages=[USER], **body)
        else:
            chunks = client.completions.create(prompt="the quick", **body)
        return [c.model_dump(exclude={"id", "created"}) for c in chunks]

    plain = stream()
    assert plain[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert stream(include_obfuscation=False) == plain
    with pytest.raises(openai.BadRequestError) as e:
        stream(include_obfuscation=True)
    assert (e.value.param, e.value.code) == ("stream_options.include_obfuscation",
                                             "unsupported_parameter")
