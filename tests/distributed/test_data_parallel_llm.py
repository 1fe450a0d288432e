"""``LLM(model, data_parallel_size=2)``: two engine-core processes behind the offline API.

Greedy tokens equal the one-process engine's (itself checked against HF transformers in
tests/models/test_parity.py); the four prompts, queued at once, alternate between the replicas
(the balancer's least-depth rule: worked out below), which each replica's prefix-cache query
count shows; ``reset_prefix_cache`` reaches every replica; a replica killed mid-run makes
``generate`` raise naming it, and the LLM goes on serving on the other one.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import GREEDY, PROMPTS, assert_same_greedy


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=96,
              max_num_batched_tokens=32, data_parallel_size=2)
    yield llm
    llm.shutdown()
    assert all(not c.is_alive for c in llm.engine.core.cores)  # no orphan replica


def _tokens(outs) -> list:
    return [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs]


def test_greedy_equals_one_process_and_prompts_alternate(dp_llm, tiny_model_factory,
                                                         single_process_greedy):
    client = dp_llm.engine.core
    assert len({c.pid for c in client.cores}) == 2 and all(c.is_live for c in client.cores)
    outs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_greedy(single_process_greedy("llama"), _tokens(outs))
    # depths when each prompt is queued: [0,0] -> 0, [1,0] -> 1, [1,1] -> 0 (tie, equal KV
    # use: lowest index), [2,1] -> 1. Each replica looks up its prompts' tokens once.
    lengths = [len(p) for p in PROMPTS]  # 6, 21, 4, 40
    assert [s.prefix_cache_queries for s in client.stats] == [lengths[0] + lengths[2],
                                                               lengths[1] + lengths[3]]
    assert client.balancer.depth == [0, 0] and not client.has_unfinished_requests()


def test_reset_prefix_cache_asks_every_replica(dp_llm, single_process_greedy):
    """``LLM.reset_prefix_cache()`` over the replicas: a 40-token prompt sent again hits its 2
    whole blocks of 16 (32 tokens, hand-computed; the balancer sends it to the replica that
    cached it), after a reset none. From an ``on_output`` callback mid-run it is refused
    while a replica still runs requests, and the outputs the replicas send meanwhile are kept:
    the tokens equal the one-process run's."""
    prompt = {"prompt_token_ids": PROMPTS[3]}
    assert dp_llm.reset_prefix_cache() is True  # an earlier test may have cached it
    hits = [dp_llm.generate(prompt, GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens
            for _ in range(2)]
    assert dp_llm.reset_prefix_cache() is True
    hits.append(dp_llm.generate(prompt, GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens)
    assert hits == [0, 32, 0]
    answers = []
    outs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False, on_output=lambda i, out: (
        answers.append(dp_llm.reset_prefix_cache())))
    # resets asked between a run's outputs lose none of them (a reset may succeed there:
    # both replicas can be idle while their last outputs are still on the way; on a loaded
    # machine a prompt's outputs may all come in one message, its finished one)
    assert len(answers) >= len(PROMPTS)
    assert_same_greedy(single_process_greedy("llama"), _tokens(outs))
    first = []
    long_run = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    dp_llm.generate(PROMPTS, long_run, use_tqdm=False, on_output=lambda i, out: (
        first or first.append(dp_llm.reset_prefix_cache())))
    assert first == [False]  # at the first of 200 tokens every replica still runs


def test_a_killed_replica_is_named_and_the_other_keeps_serving(dp_llm, single_process_greedy):
    client = dp_llm.engine.core
    handle, killed = client._handle, []

    def kill_replica_one_on_first_output(msg):
        if not killed:
            os.kill(client.cores[1].pid, signal.SIGKILL)
            killed.append(True)
        handle(msg)

    client._handle = kill_replica_one_on_first_output
    try:
        with pytest.raises(RuntimeError, match=r"engine core 1 of 2 process exited with code"):
            dp_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        client._handle = handle
    assert client.balancer.depth == [0, 0]  # the aborted requests are no longer counted
    outs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # all on replica 0 now
    assert_same_greedy(single_process_greedy("llama"), _tokens(outs))
    assert [c.is_live for c in client.cores] == [True, False]
