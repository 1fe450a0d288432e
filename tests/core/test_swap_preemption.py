"""Swap preemption (--preemption-mode swap): a preempted request's KV blocks go to a host pool
and come back, instead of being recomputed.

Oracles: the same prompts on an engine whose KV pool never runs out (no preemption at all):
greedy fp32 tokens must be identical; the pools' own counters (every device block free, every
host block free) after the run; hand-computed costs for the swap-or-recompute rule.
"""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.core.kv_swap import SwapManager
from kvflow.core.step_time_model import StepFeatures, StepTimeModel
from kvflow.kv_cache_interface import FullAttentionSpec
from kvflow.worker.kv_swap import HostKVCache
from tests.core.swap_checks import always_swap, assert_swapped_back_and_pools_idle

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "kvflow pages keys and values",
           "swap preemption copies blocks to host memory and back again " * 2, "a b c d e f",
           "chunked prefill splits long prompts", "one more prompt to fill the pool"]


def _run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    return _run(LLM(model=tiny_llama.path, dtype="float32", block_size=16, num_kv_blocks=256))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swapped_outputs_equal_unpreempted_and_pools_end_idle(tiny_llama, expected, monkeypatch,
                                                              prefix_caching):
    always_swap(monkeypatch)
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=16, num_kv_blocks=14,
              enable_prefix_caching=prefix_caching, preemption_mode="swap", swap_space="1MiB")
    assert _run(llm) == expected
    core = llm.engine.core
    assert_swapped_back_and_pools_idle(core)
    runner = core.executor.runner
    assert runner.host_kv is not None and \
        runner.host_kv.host_caches[0].shape[1] == core.kv_cache_config.num_host_blocks
    assert len(runner.host_kv.host_caches) == len(runner.kv_caches)  # K/V only: no scales


def test_recompute_mode_has_no_host_pool(tiny_llama, expected):
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=16, num_kv_blocks=14)
    assert _run(llm) == expected
    assert llm.engine.core.scheduler.swap is None
    assert llm.engine.core.scheduler.num_preemptions > 0


class _Held:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.block_size = 16

    def num_held_blocks(self, request_id: str) -> list[int]:
        return [self.blocks]


class _Req:
    request_id = "r"

    def __init__(self, n: int) -> None:
        self.num_computed_tokens = n


def test_cost_rule_swaps_long_contexts_and_recomputes_short_ones():
    """Recompute time of n tokens = c1 n + c3 n (n + 1) / 2 (the fitted model without c0);
    swap time = 2 n bytes_per_token / 4e9 s. With c1 = 1e-5 s/token, c3 = 1e-7 s/key and
    40,000 bytes per token (swap 2e-5 s per token) swapping wins when 1e-5 + 1e-7 (n + 1) / 2
    > 2e-5, i.e. n > 199: 64 tokens are recomputed, 512 swapped. A context whose blocks do not
    fit the host pool is recomputed, and so is one with nothing computed."""
    model = StepTimeModel(min_steps=4)
    rng = np.random.default_rng(0)
    for _ in range(64):
        n, d = int(rng.integers(1, 500)), int(rng.integers(0, 8))
        f = StepFeatures(n, d, n * (n + 1) // 2 + d * int(rng.integers(1, 2000)))
        model.observe(f, 0.002 + 1e-5 * n + 1e-4 * d + 1e-7 * f.context_tokens)
    np.testing.assert_allclose(model.coef, [0.002, 1e-5, 1e-4, 1e-7], rtol=1e-6)
    swap = SwapManager(_Held(4), 8, 40_000, model)
    assert not swap.should_swap(_Req(64)) and swap.should_swap(_Req(512))
    assert not SwapManager(_Held(9), 8, 40_000, model).should_swap(_Req(512))  # host too small
    assert not swap.should_swap(_Req(0))


def test_host_pool_takes_memory_only_where_written():
    """A 512 MiB host pool (bfloat16, as a 16-bit model's) reads as zeros and adds only the
    pages a swap-out writes to the process's resident memory (psutil): it used to be
    written in full at start-up (torch.zeros), so the default --swap-space 4GiB cost 4 GiB of
    RAM and ~9 s before the first request, swapped or not. Blocks still round-trip."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    device = [torch.randn(spec.kv_cache_shape(4)).to(torch.bfloat16) for _ in range(2)]
    num_host = 512 * 2**20 // (2 * device[0][:, 0].numel() * 2)  # 2 layers x 256 MiB
    process = psutil.Process()
    before = process.memory_info().rss
    host = HostKVCache([(d, 1) for d in device], num_host)
    assert process.memory_info().rss - before < 64 * 2**20
    assert host.host_caches[1].shape == spec.kv_cache_shape(num_host)
    assert host.host_caches[1].dtype == torch.bfloat16
    assert not host.host_caches[1][:, [0, num_host // 2, num_host - 1]].any()
    host.swap_out([(1, num_host - 1), (3, 7)])
    device_copy = [d.clone() for d in device]
    for d in device:
        d.zero_()
    host.swap_in([(num_host - 1, 2), (7, 0)])
    for d, original in zip(device, device_copy):
        assert torch.equal(d[:, 2], original[:, 1]) and torch.equal(d[:, 0], original[:, 3])
