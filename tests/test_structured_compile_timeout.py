"""A slow grammar must not hold the engine's other constrained requests: on the tiny model,
with a 0.5 s compile limit, a grammar whose compile blocks (xgrammar's compile patched to
wait on an event for it; real slow grammars need a 49k vocabulary and seconds of CPU) and a
fast regex are queued together. The regex request finishes, its text matching the regex,
while the slow one still compiles; the slow one then ends with the timeout error, holds no
KV block, and an identical request is refused without a second compile."""

from __future__ import annotations

import re
import threading
import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.streams import RequestRefused
from kvflow.structured import StructuredOutputsParams
from kvflow.structured.xgrammar_backend import XgrammarBackend

SLOW = 'root ::= "slow" [a-z]*'
PATTERN = r"[a-c]{2,4}-\d"


@pytest.fixture
def blocked(monkeypatch):
    """XgrammarBackend.compile, waiting on the returned event for the grammar ``SLOW``;
    ``calls`` counts its compiles."""
    release, calls = threading.Event(), []
    compile_ = XgrammarBackend.compile

    def compile_blocking(self, params):
        if params.grammar == SLOW:
            calls.append(params.grammar)
            release.wait(20)
        return compile_(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_blocking)
    release.calls = calls
    yield release
    release.set()


@pytest.fixture
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, num_kv_blocks=32, block_size=16,
               structured_output_compile_timeout=0.5)


def _add(llm, grammar=None, regex=None, seed=0) -> str:
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(grammar=grammar,
                                                                       regex=regex))
    return llm.engine.add_request("the quick brown fox", params)


def _run(llm, num_requests: int, timeout_s: float = 20.0) -> dict:
    """Step the engine core until ``num_requests`` requests finished; returns, by request
    id, (token ids, the finishing core output, seconds after the start) (core outputs, so
    their ``error`` is seen)."""
    engine, start = llm.engine, time.monotonic()
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple] = {}
    while len(finished) < num_requests:
        assert time.monotonic() - start < timeout_s, f"stuck; finished: {finished}"
        outputs = engine.core.step()
        parents = [engine.output_processor.parent_of(o.request_id) for o in outputs]
        engine.output_processor.process(outputs)
        for parent, out in zip(parents, outputs):
            tokens.setdefault(parent, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[parent] = (tokens[parent], out, time.monotonic() - start)
    return finished


def test_fast_grammar_finishes_while_slow_one_compiles_then_times_out(llm, blocked):
    pool = llm.engine.core.kv_cache_manager.pool
    free_at_start = pool.num_free_blocks
    slow_id = _add(llm, grammar=SLOW)
    fast_id = _add(llm, regex=PATTERN, seed=1)
    done = _run(llm, 2)
    fast_tokens, fast, fast_s = done[fast_id]
    _, slow, slow_s = done[slow_id]
    assert fast.error is None and fast.finish_reason == "stop"
    text = llm.get_tokenizer().decode(fast_tokens, skip_special_tokens=True)
    assert re.fullmatch(PATTERN, text), text
    assert fast_s < slow_s and not blocked.is_set()  # while the slow one still compiled
    assert slow.finish_reason == "abort" and slow.new_token_ids == []
    assert "the grammar did not compile within 0.5 s" in slow.error
    assert slow_s >= 0.45
    assert not llm.engine.core.has_unfinished_requests()
    assert pool.num_free_blocks == free_at_start

    again_id = _add(llm, grammar=SLOW)  # refused at its first step, no second compile
    _, again, again_s = _run(llm, 1)[again_id]
    assert again.error == slow.error and again_s < 0.4
    assert blocked.calls == [SLOW]
    fast_again = _add(llm, regex=PATTERN, seed=2)  # the engine keeps serving grammars
    fast_tokens, out, _ = _run(llm, 1)[fast_again]
    assert out.finish_reason == "stop"
    assert re.fullmatch(PATTERN, llm.get_tokenizer().decode(fast_tokens,
                                                            skip_special_tokens=True))
    assert pool.num_free_blocks == free_at_start


def _params(grammar=None, regex=None, seed=0) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=12,
                          structured_outputs=StructuredOutputsParams(grammar=grammar,
                                                                     regex=regex))


def test_generate_raises_the_timeout_naming_the_prompt(llm, blocked):
    """Offline, the core's error is ``LLM.generate``'s ValueError (``RequestRefused``) naming
    the prompt; the call's other request is aborted, no KV block stays held, and the engine
    keeps serving (the same grammar is refused again at once, a regex still runs)."""
    pool = llm.engine.core.kv_cache_manager.pool
    free_at_start = pool.num_free_blocks
    prompts = ["the quick brown fox", "the quick brown fox"]
    with pytest.raises(RequestRefused) as raised:
        llm.generate(prompts, [_params(regex=PATTERN, seed=1), _params(grammar=SLOW)],
                     use_tqdm=False)
    assert isinstance(raised.value, ValueError)
    assert str(raised.value).startswith(
        "prompt 1: the grammar did not compile within 0.5 s")
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.has_unfinished_requests()
    assert pool.num_free_blocks == free_at_start

    began = time.monotonic()
    with pytest.raises(RequestRefused, match=r"^prompt 0: the grammar "
                                             r"did not compile within 0\.5 s"):
        llm.generate("the quick brown fox", _params(grammar=SLOW), use_tqdm=False)
    assert time.monotonic() - began < 0.4 and blocked.calls == [SLOW]  # no second compile
    (out,) = llm.generate("the quick brown fox", _params(regex=PATTERN, seed=2),
                          use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(PATTERN, out.outputs[0].text), out.outputs[0].text
    assert pool.num_free_blocks == free_at_start
