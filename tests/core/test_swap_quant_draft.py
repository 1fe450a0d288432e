"""Swap preemption with a quantized KV cache and with a draft model: the host pool holds the
int8 / fp8 K/V with their per-token scales, and a draft model's K/V under the same host block
ids, and copies them all both ways.

Oracles: the same engine with a KV pool that never runs out (no preemption): identical greedy
tokens and logprobs within fp32 tolerance (a quantized cache changes the logits, so it is
compared with itself unpreempted); transformers' greedy tokens for the plain fp32 draft run;
with the target as its own draft nearly every draft is accepted, which fails if the draft's
K/V restored after a swap-in were not the request's own; the pools' counters (every device
and host block free) after the run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_sizing import num_host_blocks
from kvflow.core.kv_swap import SwapManager
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvflow.worker import step_inputs
from tests.core.swap_checks import always_swap
from tests.spec_decode.test_ngram_engine import PROMPTS as DRAFT_PROMPTS
from tests.spec_decode.test_ngram_engine import _drafted
from tests.test_generation_config import hf_greedy

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "kvflow pages keys and values",
           "swap preemption copies blocks to host memory and back again " * 2, "a b c d e f",
           "chunked prefill splits long prompts", "one more prompt to fill the pool"]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)


def _check_same(got, expected) -> None:
    """Identical greedy tokens; each position's top logprobs equal within fp32 tolerance."""
    for g, e in zip(got, expected):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_g, lp_e in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert lp_g.keys() == lp_e.keys()
            np.testing.assert_allclose([lp_g[t].logprob for t in lp_g],
                                       [lp_e[t].logprob for t in lp_g], rtol=1e-4, atol=1e-4)


def _check_pools_idle(llm: LLM, assert_no_leaks) -> None:
    """Swaps happened, every swapped request came back, no device or host block is held."""
    core = llm.engine.core
    swap = core.scheduler.swap
    assert core.scheduler.num_preemptions > 0 and swap.num_swapped_out > 0
    assert swap.num_swapped_in == swap.num_swapped_out
    swap.release_read_blocks()  # the last swap-in's host blocks (freed at the next schedule)
    assert swap.host.num_free_blocks == swap.host.num_blocks and not swap.swapped
    assert_no_leaks(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_swaps_its_scales(tiny_llama, monkeypatch, assert_no_leaks,
                                             kv_cache_dtype):
    """A quantized block is read through its scales: a swap-in that brought the K/V back
    without them would dequantize with the scales some earlier request left in the new
    device blocks, and the tokens would change."""
    kw = {"model": tiny_llama.path, "dtype": "float32", "block_size": 16,
          "kv_cache_dtype": kv_cache_dtype}
    expected = LLM(num_kv_blocks=256, **kw).generate(PROMPTS, PARAMS, use_tqdm=False)
    always_swap(monkeypatch)
    llm = LLM(num_kv_blocks=14, preemption_mode="swap", swap_space="1MiB", **kw)
    _check_same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), expected)
    _check_pools_idle(llm, assert_no_leaks)
    runner = llm.engine.core.executor.runner
    host = runner.host_kv
    assert len(host.host_caches) == 2 * len(runner.kv_caches)  # K/V and scales per tensor
    scales = [h for h in host.host_caches if h.dtype != runner.kv_caches[0].dtype]
    assert len(scales) == len(runner.kv_caches)
    assert scales[0].shape[1] == llm.engine.core.kv_cache_config.num_host_blocks
    assert any(s.any() for s in scales)  # the swap-outs wrote scales to the host pool


def _restored_draft_counts(monkeypatch) -> list[int]:
    """Record, for each request swapped back in, the draft K/V positions its new row starts
    with (0 would mean the draft recomputes its whole context)."""
    restored: list[int] = []
    original = step_inputs.apply_scheduler_output

    def spy(batch, sched, states):
        original(batch, sched, states)
        swapped_in = {d for _, d in sched.blocks_to_swap_in}
        for rid in sched.scheduled_cached_reqs.resumed_req_ids:
            row = batch.req_id_to_index[rid]
            if swapped_in & set(batch.block_tables[0][row, :batch.num_blocks[0][row]].tolist()):
                restored.append(int(batch.num_draft_computed[row]))

    monkeypatch.setattr(step_inputs, "apply_scheduler_output", spy)
    return restored


def test_draft_model_kv_is_swapped_with_the_target(tiny_llama, monkeypatch, assert_no_leaks):
    """The target drafts for itself (float32, its K/V as the target's): tokens equal
    transformers' and the unpreempted run's, >= 95% of drafts are accepted, and requests
    swapped back in resume their draft K/V instead of recomputing it."""
    prompts = [DRAFT_PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    spec = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 3,
            "adaptive": False, "quantization": "none"}
    kw = {"model": tiny_llama.path, "dtype": "float32", "block_size": 4,
          "speculative_config": spec}
    expected = LLM(num_kv_blocks=300, **kw).generate(prompts, params, use_tqdm=False)
    always_swap(monkeypatch)
    restored = _restored_draft_counts(monkeypatch)
    llm = LLM(num_kv_blocks=40, max_num_seqs=6, preemption_mode="swap", swap_space="4MiB", **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    _check_same(got, expected)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, got):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, tokenizer.encode(prompt), 40)
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted >= 0.95 * drafted
    assert restored and max(restored) > 0
    _check_pools_idle(llm, assert_no_leaks)
    runner = llm.engine.core.executor.runner
    assert len(runner.host_kv.host_caches) == len(runner.kv_caches)  # target's + draft's
    assert len(runner.kv_caches) == 2 * len(llm.engine.core.kv_cache_config.draft_group
                                            .layer_names)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_async_scheduling_swaps(tiny_llama, monkeypatch, assert_no_leaks, prefix_caching):
    """Async scheduling preempts requests whose step N is still in flight: their swap-out is
    the first thing step N+1's launch does, after step N's forward wrote their K/V (the same
    thread on CPU, the same stream on CUDA), and host blocks a swap-in of step N read are
    freed only when N+1 is scheduled, after N's launch read them. Tokens and logprobs equal
    lock-step scheduling without preemption."""
    kw = {"model": tiny_llama.path, "dtype": "float32", "block_size": 16,
          "enable_prefix_caching": prefix_caching}
    expected = LLM(num_kv_blocks=256, **kw).generate(PROMPTS, PARAMS, use_tqdm=False)
    always_swap(monkeypatch)
    in_flight: list[int] = []  # per swap-out: the victim's tokens still out (step N's)
    swap_out = SwapManager.swap_out

    def spy(self, request):
        in_flight.append(request.num_output_placeholders)
        return swap_out(self, request)

    monkeypatch.setattr(SwapManager, "swap_out", spy)
    llm = LLM(num_kv_blocks=14, preemption_mode="swap", swap_space="1MiB",
              async_scheduling=True, **kw)
    assert llm.engine.core.scheduler.async_scheduling
    _check_same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), expected)
    _check_pools_idle(llm, assert_no_leaks)
    assert max(in_flight) > 0  # some victims were swapped out with step N in flight


def test_pool_sizing_counts_scales_and_the_draft_and_context_parallel_shares():
    """A host block holds what a device block id holds: int8 K/V of 2 layers (2 x 16 tokens x
    2 heads x 64 dims x 1 byte each) plus their float32 scales (2 x 16 x 2 x 4 bytes), and a
    one-layer draft of the same spec; 1MiB / that is the pool, with async scheduling and
    pipeline parallelism too (a stage holds fewer layers: less memory). A context-parallel
    rank holds half of every block at CP=2: twice the blocks in the same 1MiB."""
    spec = FullAttentionSpec(16, 2, 64, torch.int8, torch.float32)
    pool = KVCacheConfig(8, (KVCacheGroupSpec(("l.0", "l.1"), spec),),
                         KVCacheGroupSpec(("draft_model.l.0",), spec))
    page = 3 * (2 * 16 * 2 * 64 + 2 * 16 * 2 * 4)
    assert pool.page_size_bytes == page
    swap = {"preemption_mode": "swap", "swap_space": "1MiB"}
    for kwargs in ({"async_scheduling": True}, {"pipeline_parallel_size": 2}):
        assert num_host_blocks(EngineConfig.from_kwargs(**kwargs, **swap),
                               pool) == 2**20 // page
    assert num_host_blocks(EngineConfig.from_kwargs(context_parallel_size=2, **swap),
                           pool) == 2 * 2**20 // page
