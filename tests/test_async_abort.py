"""Aborts of an in-process ``AsyncLLM``'s requests.

``AsyncLLM.abort`` called by another task than the one reading the request's stream (an
in-process program's cancel button, a watchdog): the reader's stream ends with a last output
whose unfinished samples have ``finish_reason`` ``"abort"``, as vLLM's ``AsyncLLM`` does, a
pending admission wait returns, and a second abort or an unknown id change nothing. Was: the
stream was dropped with nothing put on it, and its reader waited forever.

A request id used again at once after its abort: the new request gets its own tokens only
(transformers' greedy tokens). Was: the tokens the core had sent of the aborted request before
it read the abort were taken as the new request's (its output began with them, and ran past
``max_tokens``).

``AsyncLLM.abort`` also returns an already-done awaitable and takes several ids, so vLLM 0.32's
``await engine.abort(id)`` / ``await engine.abort([ids])`` work as the plain call does (was:
``TypeError: object NoneType can't be used in 'await' expression``; a list was taken as one
unknown id).

A request admission control refuses ends its stream's iteration with the refusal too, not only
its ``admitted`` wait (was: a reader that did not await ``admitted`` waited forever)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvflow import SamplingParams
from kvflow.outputs import RequestOutput
from tests.request_state import wait_until_idle
from tests.test_request_metrics import open_requests_of

PROMPT = [1, 5, 9, 13, 17, 21]
OTHER = [40, 41, 42, 43, 44, 45, 46, 47]


def _hf_greedy(tiny_llama, ids: list[int], n: int) -> list[int]:
    out = tiny_llama.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


async def _read(stream) -> list[RequestOutput]:
    return [out async for out in stream]


async def _abort_from_another_task(engine) -> tuple[list[RequestOutput], RequestOutput]:
    """A long request read by one task and aborted by this one after its first output, next
    to a short one read to its end; returns the aborted one's outputs and the other's."""
    from kvflow.engine.async_llm import collect

    await engine.start()
    try:
        survivor = engine.add_request("survivor", None, PROMPT, SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=12))
        stream = engine.add_request("long", None, PROMPT, SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=100))
        first = await stream.__anext__()
        reader = asyncio.ensure_future(_read(stream))
        engine.abort("long")
        engine.abort("long")  # twice: nothing more
        engine.abort("no-such-request")
        rest = await asyncio.wait_for(reader, 30)  # was: never returned
        kept = await asyncio.wait_for(collect(survivor), 60)
        await wait_until_idle(engine)
        return [first, *rest], kept
    finally:
        await engine.shutdown()


def _run(tiny_llama, scenario):
    """``scenario(engine)`` run on a fresh AsyncLLM of the tiny Llama (48 blocks of 4);
    returns (its result, the engine's last stats, the closed engine)."""
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=48, block_size=4))
    try:
        result = asyncio.run(scenario(engine))
        return result, engine.stats[0], engine
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_abort_from_another_task_ends_the_stream(tiny_llama):
    (outputs, kept), stats, engine = _run(tiny_llama, _abort_from_another_task)
    last = outputs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort"]
    assert all(not out.finished for out in outputs[:-1])
    tokens = [t for out in outputs for c in out.outputs for t in c.token_ids]
    assert 1 <= len(tokens) < 100
    reference = _hf_greedy(tiny_llama, PROMPT, 100)
    assert tokens == reference[:len(tokens)]
    # the other request ran on, unchanged; every KV block is free again
    assert kept.outputs[0].token_ids == reference[:12]
    assert kept.outputs[0].finish_reason == "length"
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
        (0, 0, stats.num_usable_blocks)
    success = engine.metrics.request_success
    assert success.labels(engine.metrics.model_name, "abort")._value.get() == 1
    assert success.labels(engine.metrics.model_name, "length")._value.get() == 1


async def _awaited_aborts(engine) -> list[list[RequestOutput]]:
    """vLLM 0.32's ``await engine.abort(id)`` and ``await engine.abort([ids])``: three long
    requests, each read by a task; "a" aborted by one awaited id, "b" and "c" (with an
    unknown id) by one awaited list; returns each one's outputs."""
    await engine.start()
    try:
        streams = {rid: engine.add_request(rid, None, PROMPT, SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=100)) for rid in "abc"}
        for stream in streams.values():
            await stream.__anext__()
        readers = {rid: asyncio.ensure_future(_read(s)) for rid, s in streams.items()}
        assert await engine.abort("a") is None  # was: TypeError, None is not awaitable
        assert await engine.abort(iter(["b", "c", "no-such-request"])) is None
        outputs = [await asyncio.wait_for(readers[rid], 30) for rid in "abc"]
        await wait_until_idle(engine)
        return outputs
    finally:
        await engine.shutdown()


@pytest.mark.timeout(300)
def test_abort_can_be_awaited_as_in_vllm(tiny_llama):
    outputs, stats, _ = _run(tiny_llama, _awaited_aborts)
    for rest in outputs:
        assert rest and rest[-1].finished
        assert [c.finish_reason for c in rest[-1].outputs] == ["abort"]
        assert sum(len(c.token_ids) for out in rest for c in out.outputs) < 99
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
        (0, 0, stats.num_usable_blocks)


def test_a_non_string_id_is_refused():
    from kvflow.engine.async_llm import AsyncLLM

    with pytest.raises(TypeError, match="request ids are strings, got 7"):
        AsyncLLM.abort(object.__new__(AsyncLLM), ["a", 7])


async def _reuse_after_abort(engine) -> list[RequestOutput]:
    """For n = 1, 1, 2: a long request "x" (``n`` greedy samples) aborted after its first
    output while the core's next outputs of it wait unread, then a short request "x" of
    another prompt read to its end; returns the short ones' outputs."""
    from kvflow.engine.async_llm import collect

    await engine.start()
    try:
        outputs = []
        for n in (1, 1, 2):
            old = engine.add_request("x", None, PROMPT, SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=100, n=n))
            await old.__anext__()
            time.sleep(0.3)  # noqa: ASYNC251 - blocks the loop: the core's next outputs stay unread
            engine.abort("x")
            new = engine.add_request("x", None, OTHER, SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=10, n=n))
            outputs.append(await asyncio.wait_for(collect(new), 60))
        await wait_until_idle(engine)
        return outputs
    finally:
        await engine.shutdown()


@pytest.mark.timeout(300)
def test_an_id_used_again_right_after_its_abort_gets_only_its_own_tokens(tiny_llama):
    outputs, stats, _ = _run(tiny_llama, _reuse_after_abort)
    reference = _hf_greedy(tiny_llama, OTHER, 10)
    for out, n in zip(outputs, (1, 1, 2), strict=True):
        assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [(reference, "length")] * n
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
        (0, 0, stats.num_usable_blocks)


def test_cancel_resolves_admission_and_finishes_only_the_unfinished_samples(tiny_tokenizer):
    """n=3: sample 0 got a token, sample 2 finished by length; then the caller aborts
    while one task awaits admission and another reads: both return, the last output carries
    samples 0 and 1 (no new token, reason ``abort``), and /metrics counts 2 aborted samples
    next to the finished one. A second cancel returns nothing and puts nothing."""
    from kvflow.engine.messages import EngineOutputs
    from kvflow.engine_outputs import EngineCoreOutput, EngineStats

    async def run():
        metrics, open_requests, stream, ids = open_requests_of(tiny_tokenizer, 3, admission_control=True)
        open_requests.deliver(EngineOutputs([
            EngineCoreOutput(ids[0], [9]),
            EngineCoreOutput(ids[2], [11], finish_reason="length")], EngineStats()))
        waiting = asyncio.ensure_future(stream.admitted)
        reader = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(0)
        assert open_requests.cancel("r") == (ids, 0)
        assert open_requests.cancel("r") == ([], None)
        await asyncio.wait_for(waiting, 5)
        outputs = await asyncio.wait_for(reader, 5)
        return metrics, outputs, stream

    metrics, outputs, stream = asyncio.run(run())
    assert len(outputs) == 2 and outputs[-1].finished
    assert [(c.index, c.token_ids, c.finish_reason) for c in outputs[-1].outputs] == \
        [(0, [], "abort"), (1, [], "abort")]
    assert stream._queue.empty()
    success = metrics.request_success
    assert success.labels("m", "abort")._value.get() == 2
    assert success.labels("m", "length")._value.get() == 1


def test_a_stream_admission_control_refuses_ends_for_its_reader(tiny_tokenizer):
    """Admission control refuses request "r" while a task reads its stream (without awaiting
    ``admitted`` first): the reader gets the ``AdmissionRejected`` (was: it waited forever;
    only ``admitted`` failed), and nothing of the request is left open or counted."""
    from kvflow.engine.messages import AdmissionVerdicts, Rejection
    from kvflow.engine.streams import AdmissionRejected

    async def run():
        metrics, open_requests, stream, _ = open_requests_of(tiny_tokenizer, 2, admission_control=True)
        reader = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(0)
        open_requests.settle(AdmissionVerdicts([], [Rejection("r", 3.0, "too busy")]))
        with pytest.raises(AdmissionRejected, match="too busy") as refusal:
            await asyncio.wait_for(reader, 5)
        with pytest.raises(AdmissionRejected):
            stream.admitted.result()
        return metrics, open_requests, refusal.value

    metrics, open_requests, refusal = asyncio.run(run())
    assert refusal.retry_after_s == 3.0
    assert not open_requests.streams and not open_requests.waiting
    assert open_requests.output_processor.parent_of("r-0") is None
    assert metrics.rejected._value.get() == 1
    for reason in ("stop", "length", "abort"):
        assert metrics.request_success.labels("m", reason)._value.get() == 0
