"""SLA mode (TTFT/TPOT targets) together with --async-scheduling and with n-gram speculative
decoding, on the tiny random Llama in float32: both combinations run (neither is refused).

Oracles: the same engine without targets (token for token equal greedy output: the planner
only sizes steps, it never changes what a request computes); the step count (the step-time
model must have learned from every step and predicted the steps after its first fit); the
draft counters (speculation really happened).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox jumps",
           "kvflow pages keys and values through blocks of tokens; kvflow pages keys",
           "a b a b a b a b a", "prefix caching reuses them, chunked prefill splits"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
TARGETS = {"target_tpot_ms": 50.0, "target_ttft_ms": 5000.0}


def _engine(tiny_llama, **kw) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=128,
               max_num_batched_tokens=32, **kw)


def _tokens(llm: LLM, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_planner_learned(llm: LLM) -> None:
    planner = llm.engine.core.scheduler.planner
    model = planner.model
    # 40 tokens each, at most 5 a step (4 drafts): the fit came after 16 steps and every
    # later step was planned and predicted
    assert model.is_ready and model.num_observed >= model.min_steps + 4
    assert model.num_predicted >= model.num_observed - model.min_steps - 1
    assert not planner.slos and planner._num_tpot == 0  # every finished request forgotten


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama) -> list[list[int]]:
    return _tokens(_engine(tiny_llama))


def test_sla_with_async_scheduling(tiny_llama, plain_tokens, assert_no_leaks):
    llm = _engine(tiny_llama, async_scheduling=True, **TARGETS)
    assert llm.engine.core.scheduler.async_scheduling
    assert _tokens(llm) == plain_tokens
    _check_planner_learned(llm)
    assert_no_leaks(llm)


def test_sla_with_ngram_speculation(tiny_llama, plain_tokens, assert_no_leaks):
    llm = _engine(tiny_llama, speculative_config=NGRAM, **TARGETS)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # drafts were verified
    _check_planner_learned(llm)
    assert_no_leaks(llm)
