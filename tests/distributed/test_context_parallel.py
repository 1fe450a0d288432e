"""Context parallelism (``context_parallel_size``): every sequence's KV cache split over the
CP ranks by token, each rank's partial attention merged by log-sum-exp
(kvflow/attention/cp_paged.py).

* the merge rule against plain torch SDPA over all keys (keys dealt out by position mod N,
  so some queries have no key on some rank);
* the engine with CP=2 (2 worker processes, gloo) gives the one-process greedy tokens (itself
  checked against HF transformers in tests/models/test_parity.py), over chunked prefills,
  prefix-cache hits and decodes, with each rank's cache holding block_size / 2 tokens of every
  block;
* the configurations it does not cover are refused in one line.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM
from kvflow.attention.cp_paged import merge_partials, partial_attention
from kvflow.config import EngineConfig
from tests.distributed.conftest import GREEDY, PROMPTS, assert_same_greedy, greedy_run


@pytest.mark.parametrize("n", [2, 3])
def test_merged_partials_equal_attention_over_all_keys(n):
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, num_q, num_k, dim = 2, 4, 2, 5, 12, 8
    q = torch.randn(batch, heads, num_q, dim, generator=g, dtype=torch.float64).float()
    k = torch.randn(batch, kv_heads, num_k, dim, generator=g)
    v = torch.randn(batch, kv_heads, num_k, dim, generator=g)
    q_pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # a prompt, a later chunk
    kv_pos = torch.arange(num_k)
    mask = (kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, Q, K]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    outs, lses = [], []
    for rank in range(n):
        keep = kv_pos % n == rank
        out, lse = partial_attention(q, k[:, :, keep], v[:, :, keep], mask[..., keep], 0.3)
        outs.append(out)
        lses.append(lse)
    # query at position 0 has its only key on rank 0: the other ranks' parts are empty
    assert all(torch.isneginf(lse[0, :, 0]).all() for lse in lses[1:])
    assert all((out[0, :, 0] == 0).all() for out in outs[1:])
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_single_part_merges_to_itself():
    out, lse = torch.randn(1, 3, 4), torch.randn(1, 3)
    torch.testing.assert_close(merge_partials(out, lse), out[0])
    # two parts with log-sum-exps log(1) and log(3): weights 1/4 and 3/4, by hand
    outs = torch.stack([torch.ones(2, 4), torch.full((2, 4), 5.0)])
    lses = torch.log(torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    torch.testing.assert_close(merge_partials(outs, lses), torch.full((2, 4), 4.0))


def assert_close_logprobs(reference: list, got: list, atol: float = 1e-4) -> None:
    """Each sampled token's logprob equals the reference's while the tokens agree (the merged
    attention is the one-rank attention up to float rounding)."""
    compared = 0
    for ref, out in zip(reference, got):
        for (ref_id, ref_lp), (out_id, out_lp) in zip(ref, out):
            if ref_id != out_id:
                break
            assert abs(ref_lp[ref_id].logprob - out_lp[out_id].logprob) < atol
            compared += 1
    assert compared >= len(reference) * 5


@pytest.mark.parametrize("model", ["llama", "gemma3"])  # gemma3: sliding window + global
def test_context_parallel_greedy_equals_one_process(tiny_model_factory, single_process_greedy,
                                                    model):
    got, llm = greedy_run(tiny_model_factory(model).path, shutdown=False,
                          context_parallel_size=2)
    try:
        assert_same_greedy(single_process_greedy(model), got)
        assert_close_logprobs(single_process_greedy(model), got)
        shapes = llm.engine.core.executor.collective_rpc("kv_cache_shapes")
        block_size = llm.engine.core.config.cache_config.block_size
        assert all(s[2] == block_size // 2 for rank in shapes for s in rank), shapes
        # each rank holds half of every block: the CPU's 2 GiB budget counts twice
        core = llm.engine.core
        budgets = core.executor.collective_rpc("determine_available_memory",
                                               core.kv_cache_config.kv_cache_groups)
        assert budgets == [2 * 2 * 2**30] * 2
        # the same prompts again: prefix-cache hits read K/V that each rank stored
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.core.kv_cache_manager.num_hits > 0
        assert_same_greedy(single_process_greedy(model),
                           [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs))
                            for o in again])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, needle", [
    ({"context_parallel_size": 2, "block_size": 5}, "block_size=5 must be a multiple"),
    ({"context_parallel_size": 2, "kv_cache_dtype": "int8"}, "not available with"),
    ({"context_parallel_size": 2, "pipeline_parallel_size": 2}, "tensor parallelism only"),
    ({"context_parallel_size": 2, "enable_expert_parallel": True}, "tensor parallelism only"),
])
def test_unsupported_combinations_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_kwargs(model="x", **kwargs)
    with pytest.raises(ValueError, match=needle):
        LLM(model="/nonexistent/model", **kwargs)


@pytest.mark.distributed_slow
@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                    reason="slow: run scripts/test_distributed_slow.sh")
def test_tensor_and_context_parallel_greedy_equals_one_process(tiny_model_factory,
                                                               single_process_greedy):
    """TP=2 x CP=2: 4 worker processes, ranks (cp_rank * 2 + tp_rank)."""
    got, _ = greedy_run(tiny_model_factory("llama").path, tensor_parallel_size=2,
                        context_parallel_size=2)
    assert_same_greedy(single_process_greedy("llama"), got)
    assert_close_logprobs(single_process_greedy("llama"), got)
