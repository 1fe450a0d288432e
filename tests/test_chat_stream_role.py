"""A chat stream's role chunk comes with the first output, as vLLM's server sends it: a
client that times TTFT to its first chunk (``vllm bench serve``) then includes the queueing
and prefill it waited for. Checked on ``OpenAIServingChat._chunks`` with a fake request stream
that is held until the test releases it (no engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvflow.config import ServerConfig
from kvflow.entrypoints.chat_output import ChatOutputParser
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.serving_chat import OpenAIServingChat
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput


class HeldStream:
    """One request's outputs: nothing until ``release`` is set (the engine still
    prefilling), then ``outputs`` one by one."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.release, self.outputs = asyncio.Event(), outputs

    async def __aiter__(self):
        await self.release.wait()
        for out in self.outputs:
            yield out


def _delta(text: str, finish_reason: str | None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [7], None, None,
                                                              finish_reason)],
                         finish_reason is not None, RequestMetrics(arrival_time=0.0))


async def _collect(outputs: list[RequestOutput]) -> tuple[list, list]:
    chat = OpenAIServingChat(SimpleNamespace(tokenizer=None), ServerConfig(), "m")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    stream = HeldStream(outputs)
    chunks = chat._chunks(req, "r", [1, 2], [stream], ChatOutputParser(None, None))
    first = asyncio.ensure_future(chunks.__anext__())
    await asyncio.sleep(0.05)  # the stream holds: no chunk may be out yet
    before_output = [first.result()] if first.done() else []
    stream.release.set()
    got = [await first] if not before_output else before_output
    got += [c async for c in chunks]
    return before_output, got


def test_role_chunk_waits_for_the_first_output():
    before, chunks = asyncio.run(_collect([_delta("Hel", None), _delta("lo", "stop")]))
    assert before == []  # was the role chunk, at admission
    deltas = [c.choices[0].delta for c in chunks]
    assert [(d.role, d.content) for d in deltas] == [("assistant", ""), (None, "Hel"),
                                                     (None, "lo")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_without_output_still_sends_the_role():
    _, chunks = asyncio.run(_collect([]))
    assert [(c.choices[0].delta.role, c.choices[0].delta.content) for c in chunks] == \
        [("assistant", "")]
