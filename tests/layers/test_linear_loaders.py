"""Fused linear loaders: each checkpoint tensor lands in its rows, a bad shard_id is a
ValueError naming it (oracle: the projections concatenated by hand)."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear


def test_qkv_rows_and_bad_shard_id():
    layer = QKVParallelLinear(hidden_size=8, head_dim=4, num_heads=2, num_kv_heads=1)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
        layer.weight_loader(layer.weight, tensor, shard_id)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    with pytest.raises(ValueError, match="'o'"):
        layer.weight_loader(layer.weight, q, "o")


def test_merged_rows_and_bad_shard_id():
    layer = MergedColumnParallelLinear(8, [6, 6])
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    for bad in (None, 2, -1):
        with pytest.raises(ValueError, match="shard_id"):
            layer.weight_loader(layer.weight, gate, bad)
