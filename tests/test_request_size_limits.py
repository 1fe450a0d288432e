"""Huge ``tools`` and ``logit_bias`` kept from holding the server's event loop beyond their
caps (tests/test_nested_request_fields.py): the tools' JSON schemas checked in a worker thread
when there are many, a ``logit_bias`` larger than the model's vocabulary refused before its
entries are read, and errors about one entry of a huge bias that show that entry, not the
bias. Oracles: the thread each check ran in, hand-written error bodies."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvflow.entrypoints import structured_requests
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.sampling_requests import sampling_params
from kvflow.entrypoints.structured_requests import RequestFieldError, check_tools_off_loop
from kvflow.sampling_params import SamplingParams

HI = [{"role": "user", "content": "hi"}]


def _tools(n: int, last: dict | None = None) -> list:
    tools = [{"type": "function", "function": {"name": f"f{i}",
                                               "parameters": {"type": "object"}}}
             for i in range(n)]
    if last is not None:
        tools[-1]["function"]["parameters"] = last
    return ChatCompletionRequest.model_validate({"messages": HI, "tools": tools}).tools


@pytest.mark.parametrize("n, in_thread", [(structured_requests.TOOLS_INLINE, False),
                                          (structured_requests.TOOLS_INLINE + 1, True),
                                          (2048, True)])
def test_many_tools_are_checked_off_the_event_loop(monkeypatch, n, in_thread):
    """Each tool's JSON schema is checked against its meta-schema (~0.5 ms a tool: 2,048
    tools held the loop 1.2 s); more than TOOLS_INLINE tools are checked in a worker
    thread, with the same error for a bad schema (param and words of the inline check)."""
    threads = []
    check = structured_requests.check_tools
    monkeypatch.setattr(structured_requests, "check_tools",
                        lambda *a: threads.append(threading.get_ident()) or check(*a))

    async def run(tools):
        loop_thread = threading.get_ident()
        try:
            await check_tools_off_loop(tools)
        finally:
            assert (threads.pop() != loop_thread) is in_thread

    asyncio.run(run(_tools(n)))
    with pytest.raises(RequestFieldError) as info:
        asyncio.run(run(_tools(n, {"type": "banana"})))
    assert info.value.param == f"tools.{n - 1}.function.parameters"
    assert str(info.value) == (f"tools.{n - 1}.function.parameters is not a valid JSON "
                               "schema: 'banana' is not valid under any of the given schemas "
                               "(at type)")


def _engine(vocab_size: int):
    return SimpleNamespace(processor=SimpleNamespace(vocab_size=vocab_size,
                                                     validate_params=lambda params: None))


def test_logit_bias_beyond_the_vocabulary_is_refused_before_its_entries_are_read():
    """More entries than the model has tokens cannot all name a token id: a 400 at
    logit_bias saying both counts, before the entries are turned into SamplingParams (one
    with a bad value is not what is reported); at the vocabulary's size it passes."""
    ok = ChatCompletionRequest.model_validate(
        {"messages": HI, "logit_bias": {str(i): 1 for i in range(320)}})
    assert len(sampling_params(_engine(320), ok, 1, None).logit_bias) == 320
    over = ChatCompletionRequest.model_validate(
        {"messages": HI, "logit_bias": {**{str(i): 1 for i in range(320)}, "5x": 1}})
    with pytest.raises(OpenAIError) as info:
        sampling_params(_engine(320), over, 1, None)
    assert info.value.status == 400
    assert info.value.body()["error"] == {
        "message": "logit_bias holds 321 entries, more than this model's vocabulary of 320 "
                   "tokens (each names a different token id)",
        "type": "invalid_request_error", "param": "logit_bias",
        "code": "array_above_max_length"}


@pytest.mark.parametrize("bad, message", [
    ({"7": 101}, ("SamplingParams.logit_bias={7: 101.0} is invalid: it must map token ids to "
                 "biases in [-100, 100]")),
    ({"x": 1}, ("SamplingParams.logit_bias={'x': 1} is invalid: keys must be integer token ids "
               "and values numbers")),
    ({"0007": 1}, ("SamplingParams.logit_bias={'7': 1, '0007': 1} is invalid: it names token "
                  "id 7 more than once")),
], ids=["range", "key", "twice"])
def test_an_error_in_a_huge_logit_bias_shows_the_entry_not_the_bias(bad, message):
    """The error repeated the whole bias: 100,000 entries made a 1.2 MB message (and 400
    body). Now it shows the entries at fault."""
    bias = {str(i): 1 for i in range(100_000)} | bad
    with pytest.raises(ValueError) as info:
        SamplingParams(logit_bias=bias)
    assert str(info.value) == message


@pytest.mark.parametrize("n", [1, structured_requests.TOOLS_INLINE + 1])
def test_a_tool_schema_nested_past_the_recursion_limit_is_a_400(n):
    """A tool's parameters nested 400 ``properties`` deep (jsonschema's meta-schema check
    recurses past Python's limit) is refused naming the field, inline and in the worker
    thread; the RecursionError had been a 500 on /v1/chat/completions, /tokenize and
    /invocations."""
    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(RequestFieldError) as info:
        asyncio.run(check_tools_off_loop(_tools(n, deep)))
    assert info.value.param == f"tools.{n - 1}.function.parameters"
    assert "nested too deep" in str(info.value)
