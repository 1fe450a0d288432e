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


class _FakeGpu:
    """A platform whose memory queries answer like an 80 GiB GPU."""

    name = "cuda"

    def reset_peak_memory(self):
        pass

    def memory_info(self):
        return 40 * 2**30, 80 * 2**30

    def peak_memory(self):
        return 30 * 2**30

    def peak_memory_reserved(self):
        return 32 * 2**30


def test_profile_budget_arithmetic():
    from kvflow.worker.kv_cache_setup import profile_kv_budget

    # 0.9 x 80 GiB - 30 GiB peak - (80 - 40 - 32 = 8 GiB held by others) = 34 GiB
    budget = profile_kv_budget(_FakeGpu(), 0.9, lambda: None, 4096)
    assert budget == int(0.9 * 80 * 2**30) - 38 * 2**30


def test_an_out_of_memory_profiling_step_is_a_value_error_naming_the_token_budget():
    """The profiling step (one forward of max_num_batched_tokens tokens) running out of GPU
    memory was a torch.OutOfMemoryError traceback at start-up."""
    from kvflow.worker.kv_cache_setup import profile_kv_budget

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(ValueError, match=r"max_num_batched_tokens=16384.*out of memory"):
        profile_kv_budget(_FakeGpu(), 0.9, oom, 16384)
