"""A KV-cache budget too small for 2 blocks is refused with the setting to change: on a GPU
the profiled budget (``--gpu-memory-utilization`` of its memory, less the weights, the
activation peak and other processes' use) can come out negative."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvflow.config import CacheConfig
from kvflow.core.kv_cache_sizing import make_kv_cache_config
from kvflow.kv_cache_interface import FullAttentionSpec

PAGE = 2 * 16 * 2 * 64 * 2  # K and V, 16 tokens, 2 heads of 64, bf16: bytes of one block


def _executor(budget: int) -> SimpleNamespace:
    spec = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    assert spec.page_size_bytes == PAGE
    return SimpleNamespace(get_kv_cache_spec=lambda: {"layers.0.attn": spec},
                           determine_available_memory=lambda groups: budget)


def _config(**cache) -> SimpleNamespace:
    return SimpleNamespace(cache_config=CacheConfig(**cache),
                           scheduler_config=SimpleNamespace(preemption_mode="recompute"))


def test_a_negative_profiled_budget_names_gpu_memory_utilization():
    with pytest.raises(ValueError, match=r"-0\.50 GiB.*gpu_memory_utilization=0\.3"):
        make_kv_cache_config(_executor(-2**29), _config(gpu_memory_utilization=0.3), False,
                             torch.bfloat16)


def test_a_too_small_kv_cache_memory_names_it():
    with pytest.raises(ValueError, match=r"kv_cache_memory='6KiB' holds 0 "):
        make_kv_cache_config(_executor(6 * 1024), _config(kv_cache_memory="6KiB"), False,
                             torch.bfloat16)


def test_a_budget_of_two_blocks_is_taken():
    kv = make_kv_cache_config(_executor(2 * PAGE), _config(), False, torch.bfloat16)
    assert kv.num_blocks == 2
