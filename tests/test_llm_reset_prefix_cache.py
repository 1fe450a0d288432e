"""``LLM.reset_prefix_cache()`` (vLLM's): a prompt sent again hits its whole blocks (hand-computed:
2 full blocks of 16 out of 40 tokens = 32 cached tokens); after a reset it hits none, with the
same greedy tokens as its first run. From inside a running ``generate`` (an ``on_output``
callback, before the request finished) it refuses: False, and the cache keeps its blocks (the
next run hits 32 again)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: 2 full blocks of 16, a part
HITS = 32  # the 2 full blocks


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
               block_size=16)


def run(llm: LLM, **kwargs) -> tuple[list[int], int]:
    """The prompt's greedy tokens and its prefix-cache hits."""
    (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False, **kwargs)
    return out.outputs[0].token_ids, out.metrics.num_cached_tokens


def test_reset_prefix_cache_drops_the_hits_and_keeps_the_output(llm, assert_no_leaks):
    assert llm.reset_prefix_cache() is True
    first, cached = run(llm)
    assert cached == 0
    again, cached = run(llm)
    assert (again, cached) == (first, HITS)
    assert llm.reset_prefix_cache() is True
    after, cached = run(llm)
    assert (after, cached) == (first, 0)
    assert_no_leaks(llm)


def test_reset_prefix_cache_while_requests_run_refuses_and_changes_nothing(llm):
    run(llm)  # cached now
    answers = []
    tokens, _ = run(llm, on_output=lambda i, out: out.finished or answers.append(
        llm.reset_prefix_cache()))  # the finished output comes after the request ended
    assert len(answers) == GREEDY.max_tokens - 1 and not any(answers)
    assert run(llm) == (tokens, HITS)
