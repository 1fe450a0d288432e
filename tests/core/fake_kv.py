"""A fake KV-cache config for scheduler / KV-manager tests: the groups and pool size a model
runner and the engine core would produce, without a model."""

from __future__ import annotations

import torch

from kvflow.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)


def fake_kv_cache_config(num_blocks: int, block_size: int,
                         windows: tuple[int | None, ...] = (None,)) -> KVCacheConfig:
    """One KV-cache group per entry of ``windows`` (None = full attention, else a sliding
    window in tokens), each of one layer with 1 KV head of size 8 in float32."""
    groups = []
    for g, window in enumerate(windows):
        shape = (block_size, 1, 8, torch.float32)
        spec = FullAttentionSpec(*shape) if window is None else \
            SlidingWindowSpec(*shape, window=window)
        groups.append(KVCacheGroupSpec((f"layers.{g}.attn",), spec))
    return KVCacheConfig(num_blocks, tuple(groups))
