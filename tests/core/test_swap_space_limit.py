"""``--swap-space`` (the host pool of ``--preemption-mode swap``, per worker) larger than the
machine's memory is refused while the engine core sizes the KV cache, naming the flag: 10TiB
used to reach the worker and end in numpy's ``_ArrayMemoryError`` traceback (exit status 1)."""

from __future__ import annotations

import os

import pytest
import torch

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_sizing import num_host_blocks
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
POOL = KVCacheConfig(8, (KVCacheGroupSpec(("layer.0", "layer.1"), SPEC),))
# one block: K and V (2) x 16 tokens x 2 heads x 64 dims x 4 bytes, in each of the 2 layers
PAGE = 2 * (2 * 16 * 2 * 64 * 4)
TOTAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # the machine's memory


def _config(swap_space: str) -> EngineConfig:
    return EngineConfig.from_kwargs(preemption_mode="swap", swap_space=swap_space)


def test_pool_size_in_blocks():
    assert POOL.page_size_bytes == PAGE
    assert num_host_blocks(_config("1MiB"), POOL) == 2**20 // PAGE
    assert num_host_blocks(EngineConfig.from_kwargs(), POOL) == 0  # recompute: no pool


@pytest.mark.parametrize("swap_space", [f"{TOTAL + 2**30}B", "10TiB", "10240"])
def test_swap_space_beyond_the_machines_memory_is_refused(swap_space):
    with pytest.raises(ValueError, match=rf"^--swap-space {swap_space} .* exceeds this "
                                         rf"machine's {TOTAL / 2**30:.2f} GiB of memory"):
        num_host_blocks(_config(swap_space), POOL)


def test_swap_space_up_to_the_machines_memory_is_kept():
    """The pool's pages are taken only where written (kvflow/worker/kv_swap.py), so a pool
    as large as the memory is sized, not refused."""
    assert num_host_blocks(_config(f"{TOTAL}B"), POOL) == TOTAL // PAGE
