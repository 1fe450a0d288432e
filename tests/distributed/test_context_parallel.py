"""Context parallelism (``context_parallel_size``): every sequence's KV cache split over the
CP ranks by token; prefill chunks split over the ranks with Ring Attention, decodes merged by
log-sum-exp (kvflow/attention/cp_paged.py, cp_ring.py).

* the merge rule and the ring (K/V shards in ring order, causal and sliding-window masks in
  global positions, padded queries) against plain torch SDPA over all keys;
* the engine with CP=2 (2 worker processes, gloo) gives the one-process greedy tokens (itself
  checked against HF transformers in tests/models/test_parity.py), over chunked prefills,
  prefix-cache hits and decodes, with each rank's cache holding block_size / 2 tokens of every
  block; with CP=2 and CP=3 each rank runs exactly its own prompt tokens (position mod N)
  through the model, and with ``context_parallel_prefill="replicated"`` every token (those
  exact counts in scripts/test_distributed_slow.sh; the default run's Gemma 3 case checks that
  no rank ran every token);
* the configurations it does not cover are refused in one line.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.attention import cp_ring
from kvflow.attention.cp_paged import merge_partials, partial_attention
from kvflow.attention.cp_ring import merge_two, ring_attention, window_mask
from kvflow.config import EngineConfig
from tests.distributed.conftest import GREEDY, PROMPTS, SLOW, assert_same_greedy, greedy_run


@pytest.mark.parametrize("path", ["cpu_flash", "explicit"])
@pytest.mark.parametrize("n", [2, 3])
def test_merged_partials_equal_attention_over_all_keys(n, path, monkeypatch):
    if path == "explicit":  # the score-matrix path (non-CPU devices)
        monkeypatch.setattr(cp_ring, "_cpu_flash_attention", lambda: None)
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


class _FakeRing:
    """The CP group of rank ``rank`` of ``len(shards)``, whose ring hands over the other ranks'
    shards in ring order (hop h: rank - h); records what it was sent."""

    def __init__(self, rank: int, shards: list[torch.Tensor]) -> None:
        self.rank, self.world_size, self.shards, self.sent, self.hop = rank, len(shards), \
            shards, [], 0

    def ring_shift(self, x):
        self.sent.append(x)
        self.hop += 1
        received = self.shards[(self.rank - self.hop) % self.world_size]
        return type("Shift", (), {"wait": lambda _: received})()


@pytest.mark.parametrize("n, window", [(2, None), (3, None), (3, 4)])
def test_ring_attention_equals_attention_over_all_keys(n, window):
    """Tokens dealt round-robin (position p on rank p mod n); each rank's queries attend to
    the shards arriving in ring order; the result is SDPA over the whole causal context."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, ctx, first = 4, 2, 8, 14, 5  # a chunk of positions 5..13
    q_all = torch.randn(1, heads, ctx, dim, generator=g)
    k = torch.randn(1, kv_heads, ctx, dim, generator=g)
    v = torch.randn(1, kv_heads, ctx, dim, generator=g)
    pos = torch.arange(ctx)
    mask = window_mask(pos.unsqueeze(0), pos, window)
    want = F.scaled_dot_product_attention(q_all, k, v, attn_mask=mask, scale=0.25,
                                          enable_gqa=True)
    shards = [torch.stack((k[:, :, pos % n == r], v[:, :, pos % n == r])) for r in range(n)]
    for rank in range(n):
        mine = pos[(pos % n == rank) & (pos >= first)]
        q_pos = torch.cat([mine, torch.tensor([-1])]).unsqueeze(0)  # one padding query
        q = torch.cat([q_all[:, :, mine], torch.randn(1, heads, 1, dim)], dim=2)
        ring = _FakeRing(rank, shards)
        got = ring_attention(q, q_pos, shards[rank][0], shards[rank][1],
                             lambda src: pos[pos % n == src], 0.25, window, ring)
        torch.testing.assert_close(got[:, :, :-1], want[:, :, mine], atol=1e-5, rtol=1e-5)
        assert (got[:, :, -1] == 0).all()  # the padding query: no keys, no NaN
        assert len(ring.sent) == n - 1  # N - 1 hops, own shard first
        assert torch.equal(ring.sent[0], shards[rank])


def test_merge_two_is_the_merge_of_both_parts():
    g = torch.Generator().manual_seed(2)
    outs, lses = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, generator=g)
    lses[0, 0] = float("-inf")  # row 0 has keys only in the second part
    lses[:, 2] = float("-inf")  # row 2 has none at all: stays 0, not NaN
    out, lse = merge_two(outs[0], lses[0], outs[1], lses[1])
    torch.testing.assert_close(out[:2], merge_partials(outs[:, :2], lses[:, :2]))
    torch.testing.assert_close(out[0], outs[1, 0])
    assert torch.isneginf(lse[2]) and (out[2] == 0).all()


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


# gemma3: sliding window + global; the plain llama runs in the slow script
@pytest.mark.parametrize("model", [pytest.param("llama", marks=SLOW), "gemma3"])
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
        # the ring split ran: each rank ran its own prompt tokens (about half) and every
        # decode token, not all of them (test_ring_prefill_runs_each_token_on_its_owner_only,
        # in the slow script, counts them exactly for one long prompt)
        prompt, decodes = sum(map(len, PROMPTS)), len(PROMPTS) * (GREEDY.max_tokens - 1)
        dense = [s["dense_tokens"] for s in llm.engine.core.executor.collective_rpc(
            "step_stats")]
        assert max(dense) < prompt + decodes and sum(dense) >= prompt + 2 * decodes, dense
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


LONG_PROMPT = list(range(100, 140))  # 40 tokens: 2.5 blocks of 16, chunks of 32 and 8
LONG_GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1)  # every prompt row's hidden state is gathered


def _long_prompt_run(path: str, **kwargs) -> tuple[list, list, list[dict]]:
    llm = LLM(model=path, dtype="float32", num_kv_blocks=32, max_num_batched_tokens=32,
              **kwargs)
    try:
        out_prompt = llm.generate([LONG_PROMPT], LONG_GREEDY, use_tqdm=False)[0]
        out = out_prompt.outputs[0]
        stats = llm.engine.core.executor.collective_rpc("step_stats") \
            if kwargs.get("context_parallel_size", 1) > 1 else []
    finally:
        llm.shutdown()
    prompt = [lp[token].logprob for lp, token in zip(out_prompt.prompt_logprobs[1:],
                                                      LONG_PROMPT[1:])]
    return [list(zip(out.token_ids, out.logprobs))], prompt, stats


# a 40-token prompt's exact token counts per rank, and prompt logprobs under CP: in the slow
# script (the default run's Gemma 3 CP=2 case above checks the split's bounds)
@pytest.mark.parametrize("cp, prefill, block_size", [
    pytest.param(2, "ring", 16, marks=SLOW), pytest.param(3, "ring", 24, marks=SLOW),
    pytest.param(2, "replicated", 16, marks=SLOW)])
def test_ring_prefill_runs_each_token_on_its_owner_only(tiny_llama, cp, prefill, block_size):
    """One 40-token prompt in two chunks (32 + 8 tokens) then 2 decode steps: with the ring,
    rank r runs the prompt tokens at positions p = r mod N (and both decode tokens, which
    every rank runs); replicated, every rank runs all 42. Greedy tokens, their logprobs and
    the prompt logprobs equal one process's."""
    reference, ref_prompt, _ = _long_prompt_run(tiny_llama.path, block_size=block_size)
    got, prompt, stats = _long_prompt_run(tiny_llama.path, block_size=block_size,
                                  context_parallel_size=cp, context_parallel_prefill=prefill)
    assert_same_greedy(reference, got)
    for (_, ref_lp), (token, lp) in zip(reference[0], got[0]):
        assert abs(ref_lp[token].logprob - lp[token].logprob) < 1e-4
    torch.testing.assert_close(torch.tensor(prompt), torch.tensor(ref_prompt), atol=1e-4,
                               rtol=0)
    decodes = LONG_GREEDY.max_tokens - 1
    want = [sum(1 for p in range(len(LONG_PROMPT)) if p % cp == r) + decodes for r in range(cp)]
    if prefill == "replicated":
        want = [len(LONG_PROMPT) + decodes] * cp
    assert [s["dense_tokens"] for s in stats] == want
    assert all(s["cp_comm_s"] > 0 and s["attention_s"] > 0 for s in stats)


@pytest.mark.parametrize("kwargs, needle", [
    ({"context_parallel_size": 2, "block_size": 5}, "block_size=5 must be a multiple"),
    ({"context_parallel_size": 2, "kv_cache_dtype": "int8"}, "not available with"),
    ({"context_parallel_size": 2, "pipeline_parallel_size": 2}, "tensor parallelism only"),
    ({"context_parallel_size": 2, "enable_expert_parallel": True}, "tensor parallelism only"),
    # without context parallelism the prefill mode was accepted and ignored
    ({"context_parallel_prefill": "replicated"},
     "context_parallel_prefill='replicated' applies to context_parallel_size > 1 only"),
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
