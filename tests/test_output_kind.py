"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): what an ``AsyncLLM`` stream
yields. Oracles: transformers' greedy tokens, the tokenizer's decode of them, and the
definitions (CUMULATIVE: each output the whole output so far, growing; DELTA: pieces that
join to it; FINAL_ONLY: one output, the finished one)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from kvflow import LLM, RequestOutputKind, SamplingParams
from kvflow.config import EngineConfig

IDS = [1, 5, 9, 13, 17, 21]
MAX_TOKENS = 6


def _params(kind: RequestOutputKind | None, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n,
                          output_kind=kind)


def _hf_greedy(tiny) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([IDS]), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(IDS):].tolist()


@pytest.mark.timeout(300)
def test_async_streams_yield_what_output_kind_asks(tiny_llama):
    """Was refused (no such field: TypeError); now CUMULATIVE streams the whole output so
    far at every step (snapshots: a later step does not change one already yielded),
    DELTA (and None, kvflow's default) the new pieces, FINAL_ONLY the finished output alone,
    for n=2 too."""
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=64))

    async def drain(request_id, kind, n=1):
        return [out async for out in engine.add_request(request_id, None, IDS,
                                                         _params(kind, n))]

    async def run():
        await engine.start()
        try:
            return await asyncio.gather(
                drain("cumulative", RequestOutputKind.CUMULATIVE),
                drain("delta", RequestOutputKind.DELTA), drain("default", None),
                drain("final", RequestOutputKind.FINAL_ONLY),
                drain("final2", RequestOutputKind.FINAL_ONLY, n=2))
        finally:
            await engine.shutdown()

    try:
        cumulative, delta, default, final, final2 = asyncio.run(run())
    finally:
        engine.close()
    want = _hf_greedy(tiny_llama)
    text = AutoTokenizer.from_pretrained(tiny_llama.path).decode(want, skip_special_tokens=True)

    # one output per engine step (one token each here), each the whole output so far
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert len(cumulative) > 1 and lengths == sorted(set(lengths))
    assert lengths[-1] == MAX_TOKENS
    for out in cumulative:
        assert out.outputs[0].token_ids == want[:len(out.outputs[0].token_ids)]
        assert text.startswith(out.outputs[0].text)
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    assert cumulative[-1].outputs[0].text == text

    for stream in (delta, default):
        assert len(stream) > 1
        assert [t for o in stream for t in o.outputs[0].token_ids] == want
        assert "".join(o.outputs[0].text for o in stream) == text

    (only,) = final
    assert only.finished and only.outputs[0].token_ids == want and only.outputs[0].text == text
    (only2,) = final2
    assert only2.finished and [c.index for c in only2.outputs] == [0, 1]
    assert all(c.token_ids == want for c in only2.outputs)


def test_offline_llm_returns_finished_outputs_whatever_the_kind(tiny_llama):
    """vLLM's LLM sets FINAL_ONLY on every request; kvflow's returns the finished outputs
    for every kind, the same as without one."""
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64)
    outs = llm.generate([IDS] * 4, [_params(k) for k in (None, *RequestOutputKind)],
                        use_tqdm=False)
    want = _hf_greedy(tiny_llama)
    assert all(o.finished and o.outputs[0].token_ids == want for o in outs)
    assert len({o.outputs[0].text for o in outs}) == 1


@pytest.mark.parametrize("value", [1, "DELTA"])
def test_output_kind_must_be_a_request_output_kind(value):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=value)


@pytest.mark.timeout(300)
def test_async_generate_yields_cumulative_outputs_by_default(tiny_llama):
    """vLLM's ``AsyncLLM.generate`` (was missing: AttributeError): without an output_kind it
    yields CUMULATIVE outputs, vLLM's default (each the whole output so far, the last equal to
    transformers' greedy tokens and their decode); DELTA still joins to the same; a text
    prompt is tokenized as the tokenizer encodes it; leaving the loop early aborts the
    request (no stream left open)."""
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=64))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    text_prompt = tokenizer.decode(IDS[1:])

    async def drain(request_id, prompt, kind=None):
        return [out async for out in engine.generate(prompt, _params(kind), request_id)]

    async def first_then_break():
        async for out in engine.generate(IDS, _params(None), "early"):
            return out

    async def run():
        await engine.start()
        try:
            results = await asyncio.gather(
                drain("default", IDS), drain("delta", IDS, RequestOutputKind.DELTA),
                drain("text", text_prompt), first_then_break())
            return (*results, dict(engine.requests.streams))
        finally:
            await engine.shutdown()

    try:
        default, delta, text_outs, early, still_open = asyncio.run(run())
    finally:
        engine.close()
    want = _hf_greedy(tiny_llama)
    text = tokenizer.decode(want, skip_special_tokens=True)

    lengths = [len(o.outputs[0].token_ids) for o in default]
    assert len(default) > 1 and lengths == sorted(set(lengths)) and lengths[-1] == MAX_TOKENS
    for out in default:
        assert out.outputs[0].token_ids == want[:len(out.outputs[0].token_ids)]
        assert text.startswith(out.outputs[0].text)
    assert [o.finished for o in default] == [False] * (len(default) - 1) + [True]
    assert default[-1].outputs[0].token_ids == want and default[-1].outputs[0].text == text
    assert default[-1].prompt_token_ids == IDS

    assert [t for o in delta for t in o.outputs[0].token_ids] == want
    assert "".join(o.outputs[0].text for o in delta) == text

    assert text_outs[-1].prompt == text_prompt
    assert text_outs[-1].prompt_token_ids == tokenizer.encode(text_prompt)
    assert text_outs[-1].finished and len(text_outs[-1].outputs[0].token_ids) == MAX_TOKENS

    assert not early.finished and still_open == {}


def test_async_generate_refuses_other_params():
    from kvflow.engine.async_llm import AsyncLLM

    async def run():
        async for _ in AsyncLLM.generate(object(), "hi", {"max_tokens": 4}, "r"):
            pass

    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        asyncio.run(run())
