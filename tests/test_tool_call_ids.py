"""A tool message answers a call of an earlier assistant message (its ``tool_call_id`` is that
call's ``id``), as OpenAI requires: one answering no call was rendered (HTTP 200, and offline);
now a 400 naming ``messages.N.tool_call_id`` and the id, and the same ValueError from
``LLM.chat``. LLM.chat also checks an assistant's ``tool_calls`` with the server's schema
(kvflow/chat/tool_calls.py): the same message, param and code as the server's 400 (the
message was pydantic's wording offline). Expectations are hand-written."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvflow import LLM, SamplingParams
from kvflow.chat.messages import ChatTemplateError
from kvflow.entrypoints.chat_options import ChatOptions
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.validation_errors import validation_error

# reads tool_calls and tool_call_id (so the calls stay calls)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[{{ c.id }}]{% endfor %}"
            "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")
HI = {"role": "user", "content": "hi"}


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _tool(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "42"}


def _asks(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


@pytest.fixture(scope="module")
def chat_llm(tiny_llama):
    llm = LLM(model=tiny_llama.path, num_kv_blocks=32, block_size=4, max_num_seqs=1)
    llm.engine.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def served_chat(chat_llm):
    """The server's chat handler (rendering only) on the LLM's processor and tokenizer."""
    from types import SimpleNamespace

    from kvflow.config import ServerConfig
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    engine = SimpleNamespace(tokenizer=chat_llm.engine.tokenizer,
                             processor=chat_llm.engine.processor, max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def _served(served_chat, messages: list[dict]) -> str:
    req = ChatCompletionRequest.model_validate({"messages": messages})
    return asyncio.run(served_chat.render(req.messages, ChatOptions.of(req)))[0]


UNANSWERED = [
    ([HI, _asks("c1"), _tool("c2")], 2, ("'c2' answers no tool call of an earlier assistant "
                                        "message (the calls made before it: 'c1')")),
    ([HI, _tool("c1")], 1, ("'c1' answers no tool call of an earlier assistant message (no "
                           "earlier assistant message has tool_calls)")),
    # the call comes after its answer
    ([HI, _tool("c1"), _asks("c1")], 1, ("'c1' answers no tool call of an earlier assistant "
                                        "message (no earlier assistant message has "
                                        "tool_calls)")),
    ([HI, _asks("a", "b"), _tool("b"), _tool("a"), _tool("B")], 4,
     ("'B' answers no tool call of an earlier assistant message (the calls made before it: "
     "'a', 'b')")),
]


@pytest.mark.parametrize("messages, i, why", UNANSWERED,
                         ids=["unknown", "no_calls", "call_after", "case_differs"])
def test_a_tool_message_answering_no_call_is_refused(served_chat, chat_llm, assert_no_leaks,
                                                      messages, i, why):
    param = f"messages.{i}.tool_call_id"
    with pytest.raises(OpenAIError) as served:
        _served(served_chat, messages)
    assert served.value.status == 400
    assert served.value.body()["error"] == {"message": f"{param} {why}",
                                            "type": "invalid_request_error", "param": param,
                                            "code": "invalid_value"}
    with pytest.raises(ChatTemplateError) as offline:
        chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert (offline.value.param, str(offline.value)) == (param, f"{param} {why}")
    assert_no_leaks(chat_llm)


def test_answered_calls_render_on_both_paths(served_chat, chat_llm, assert_no_leaks):
    """Answers in any order, to calls of any earlier assistant message, and several answers
    to one call (OpenAI takes them) still render (hand-written prompt)."""
    messages = [HI, _asks("a", "b"), _tool("b"), _tool("a"), HI, _asks("c"), _tool("a"),
                _tool("c")]
    expected = ("<user>hi<assistant>[a][b]<tool>42(b)<tool>42(a)<user>hi<assistant>[c]"
                "<tool>42(a)<tool>42(c)")
    assert _served(served_chat, messages) == expected
    out = chat_llm.chat(messages, SamplingParams(temperature=0, max_tokens=1),
                        add_generation_prompt=False, use_tqdm=False)
    assert out[0].prompt == expected and len(out[0].outputs[0].token_ids) == 1
    assert_no_leaks(chat_llm)


def _server_error(messages: list[dict]) -> dict:
    """The server's 400 body for a conversation its schema refuses."""
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": messages})
    errors = [{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]
    return validation_error(RequestValidationError(errors)).body()["error"]


BAD_CALLS = [  # (a bad call, the param both name, the code both give)
    ({**_call("c1"), "id": ""}, "messages.1.tool_calls.0.id", "string_below_min_length"),
    ({**_call("c1"), "id": 7}, "messages.1.tool_calls.0.id", "invalid_type"),
    ({k: v for k, v in _call("c1").items() if k != "type"}, "messages.1.tool_calls.0.type",
     "missing_required_parameter"),
    ({**_call("c1"), "type": "fn"}, "messages.1.tool_calls.0.type", "invalid_value"),
    ({**_call("c1"), "function": {"name": "f"}}, "messages.1.tool_calls.0.function.arguments",
     "missing_required_parameter"),
    ({**_call("c1"), "idx": 0}, "messages.1.tool_calls.0.idx", "unknown_parameter"),
    ({**_call("c1"), "index": -1}, "messages.1.tool_calls.0.index", "integer_below_min_value"),
]


@pytest.mark.parametrize("call, param, code", BAD_CALLS,
                         ids=["empty_id", "int_id", "no_type", "bad_type", "no_arguments",
                              "unknown_key", "negative_index"])
def test_llm_chat_refuses_the_call_shapes_the_server_refuses(chat_llm, assert_no_leaks, call,
                                                             param, code):
    messages = [HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    served = _server_error(messages)
    assert (served["param"], served["code"]) == (param, code)
    with pytest.raises(ChatTemplateError) as offline:
        chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert (offline.value.param, offline.value.code, str(offline.value)) == \
        (param, code, served["message"])
    assert_no_leaks(chat_llm)


def test_llm_chat_empty_tool_calls_and_object_arguments(chat_llm):
    """``tool_calls: []`` is refused as the server refuses it (``empty_array``); arguments
    as an object (transformers' convention) stay accepted offline."""
    with pytest.raises(ChatTemplateError) as e:
        chat_llm.chat([HI, {"role": "assistant", "content": "x", "tool_calls": []}],
                      SamplingParams(max_tokens=1), use_tqdm=False)
    assert (e.value.param, e.value.code) == ("messages.1.tool_calls", "empty_array")
    call = {**_call("c1"), "function": {"name": "f", "arguments": {"x": 1}}}
    out = chat_llm.chat([HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                         _tool("c1")], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "<user>hi<assistant>[c1]<tool>42(c1)"


# arguments text that is no JSON object's (a cut or malformed call a reply returned) is taken,
# as vLLM 0.32 takes it: tests/test_tool_call_history.py


def test_object_arguments_text_still_renders(chat_llm):
    """A JSON object's text (OpenAI's form) passes both checks and renders."""
    call = {**_call("c1"), "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    messages = [HI, {"role": "assistant", "content": None, "tool_calls": [call]}, _tool("c1")]
    ChatCompletionRequest.model_validate({"messages": messages})
    out = chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "<user>hi<assistant>[c1]<tool>42(c1)"


@pytest.fixture(scope="module")
def served_app(chat_llm):
    """The server's app (``build_app``, every route and error handler) over what its chat
    route reads of an engine before the engine is asked anything (no model runs: these
    requests are refused by the schema)."""
    from types import SimpleNamespace

    from kvflow.config import ServerConfig
    from kvflow.entrypoints.api_server import build_app

    engine = SimpleNamespace(
        tokenizer=chat_llm.engine.tokenizer, processor=chat_llm.engine.processor,
        max_model_len=4096, vocab_size=chat_llm.engine.processor.vocab_size, task="generate",
        config=SimpleNamespace(lora_config=SimpleNamespace(enable_lora=False)))
    return build_app(engine, ServerConfig(), "m")


def _post_chat(app, messages: list[dict]):
    import httpx

    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/chat/completions",
                                     json={"model": "m", "messages": messages})

    return asyncio.run(post())


C0, F0 = "messages.1.tool_calls.0", "messages.1.tool_calls.0.function"
SAME_WORDS = [  # (tool_calls sent, the message both give; hand-written)
    ([{**_call("c1"), "id": ""}], f"{C0}.id: at least 1 character, got 0"),
    ([{**_call("c1"), "id": 7}], f"{C0}.id: expected a string, got 7"),
    ([{**_call("c1"), "type": "fn"}], f"{C0}.type: expected 'function', got 'fn'"),
    ([{**_call("c1"), "idx": 0}], f"Unrecognized request argument supplied: {C0}.idx"),
    ([{**_call("c1"), "index": -1}], f"{C0}.index: at least 0, got -1"),
    ([{**_call("c1"), "index": True}], f"{C0}.index: expected an integer, got true"),
    ([{**_call("c1"), "function": "f"}], f"{F0}: expected an object, got 'f'"),
    ([{**_call("c1"), "function": {"name": 5, "arguments": "{}"}}],
     f"{F0}.name: expected a string, got 5"),
    ([{**_call("c1"), "function": {"name": "f", "arguments": [1]}}],
     f"{F0}.arguments: expected a string, got a list"),
    ([{**_call("c1"), "function": {"name": "f", "arguments": "{}", "x": 1}}],
     f"Unrecognized request argument supplied: {F0}.x"),
    ([{**_call("c1"), "function": {"name": "f"}}], f"{F0}.arguments: a required field, not sent"),
    (["x"], f"{C0}: expected an object, got 'x'"),
    ([], "messages.1.tool_calls: at least 1 item, got 0"),
    (_call("c1"), "messages.1.tool_calls: expected a list, got an object"),
]


@pytest.mark.parametrize("tool_calls, message", SAME_WORDS,
                         ids=["empty_id", "int_id", "bad_type", "unknown_key", "negative_index",
                              "bool_index", "function_text", "int_name", "list_arguments",
                              "unknown_function_key", "no_arguments", "call_text",
                              "no_calls", "calls_object"])
def test_llm_chat_says_what_the_served_400_says(served_app, chat_llm, assert_no_leaks,
                                                tool_calls, message):
    """The same bad assistant ``tool_calls`` through the server's /v1/chat/completions and
    through LLM.chat: the same message text (it was pydantic's wording offline: "String
    should have at least 1 character, got ''"), param and code."""
    messages = [HI, {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    resp = _post_chat(served_app, messages)
    assert resp.status_code == 400, resp.text
    served = resp.json()["error"]
    with pytest.raises(ValueError) as offline:
        chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert served["message"] == message
    assert (str(offline.value), offline.value.param, offline.value.code) == \
        (served["message"], served["param"], served["code"])
    assert_no_leaks(chat_llm)
