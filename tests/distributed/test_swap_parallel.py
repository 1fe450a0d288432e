"""Swap preemption (``--preemption-mode swap``) over several ranks (multiprocess executor,
gloo): pipeline_parallel_size=2 (each stage copies its own layer's K/V; two micro-batches in
flight) and context_parallel_size=2 (each rank copies its half of every block's tokens).

A pool of 16 blocks of 4 tokens cannot hold the four prompts' 31 blocks, so requests are
preempted and, with every victim swapped (the cost rule is bypassed; it is tested in
tests/core/test_swap_preemption.py), copied to the host pool and back. Oracles: the greedy
tokens and their logprobs of one process whose pool never runs out, and transformers run on
the engine's tokens (teacher forcing, fp32); at the end every device and host block is free.
A stage or rank that skipped a copy (or copied the wrong blocks) would decode from another
request's K/V or from zeros.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.core.swap_checks import always_swap, assert_swapped_back_and_pools_idle
from tests.distributed.conftest import PROMPTS, assert_same_greedy, shutdown_and_check
from tests.lora.adapters import MAX_TOKENS, check_tokens_against_peft

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
LOGPROB_ATOL = 1e-4  # a run's rounding differs by batch and by rank split (measured < 1e-5)


def _run(llm: LLM) -> list[list]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs]


@pytest.fixture(scope="module")
def unpreempted(tiny_llama) -> list[list]:
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=128)
    try:
        out = _run(llm)
        assert llm.engine.core.scheduler.num_preemptions == 0
        return out
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2},
                                      {"context_parallel_size": 2}],
                         ids=["pp2", "cp2"])
def test_swapped_requests_over_two_ranks_equal_unpreempted(tiny_llama, unpreempted, parallel,
                                                           monkeypatch):
    always_swap(monkeypatch)
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=16,
              preemption_mode="swap", swap_space="1MiB", distributed_executor_backend="mp",
              **parallel)
    try:
        got = _run(llm)
        assert_swapped_back_and_pools_idle(llm.engine.core)
    finally:
        shutdown_and_check(llm)
    assert_same_greedy(unpreempted, got)
    for ref, run in zip(unpreempted, got):
        for (_, ref_lp), (token, lp) in zip(ref, run):
            assert abs(ref_lp[token].logprob - lp[token].logprob) <= LOGPROB_ATOL
    for prompt, run in zip(PROMPTS, got):
        tokens = [token for token, _ in run]
        check_tokens_against_peft(tiny_llama.path, None, prompt, tokens,
                                  [lp[token].logprob for token, lp in run])
