"""Each tensor-parallel rank's part of a LoRA pair against the base layer's own weight
loader: the LoRA update ``W_delta = B A`` ([out, in], full) loaded through the layer's
``weight_loader`` gives the rank's slice of it, and the rank's ``B_r A_r`` must equal that
slice exactly where it is one product (column-parallel: rows; replicated KV heads included),
and ``B A_r`` the rank's columns (row-parallel: the all-reduce adds the ranks' partial sums).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvflow.lora.layers import LoRAContext, LoRALinear

TP = 2
GEN = torch.Generator().manual_seed(0)


def _rank_layers(make: Any) -> list[LinearBase]:
    return [make(rank) for rank in range(TP)]


def _loaded_delta(layer: LinearBase, deltas: dict[Any, torch.Tensor]) -> torch.Tensor:
    """The rank's slice of ``W_delta`` as the base layer's loader places it."""
    weight = layer.weight
    for shard, delta in deltas.items():
        if shard is None:
            weight.weight_loader(weight, delta)
        else:
            weight.weight_loader(weight, delta, shard)
    return weight.data.clone()


def _rank_delta(layer: LinearBase, weights: dict[Any, tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
    """The rank's ``B_r A_r`` in its output rows, from the LoRA wrapper's own slot."""
    wrapper = LoRALinear(layer, max_loras=1, max_rank=4, ctx=LoRAContext())
    wrapper.set_slot(0, wrapper.shard_weights(weights))
    return wrapper.lora_b[0].double() @ wrapper.lora_a[0].double()


def _pair(out: int, inp: int, rank: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, inp, generator=GEN), torch.randn(out, rank, generator=GEN)


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # 1: the KV head replicated on both ranks
def test_qkv_slices_match_the_base_loader(num_kv_heads):
    layers = _rank_layers(lambda r: QKVParallelLinear(16, 4, 4, num_kv_heads, tp_rank=r,
                                                      tp_size=TP))
    sizes = {"q": 16, "k": 4 * num_kv_heads, "v": 4 * num_kv_heads}
    pairs = {s: _pair(n, 16) for s, n in sizes.items()}
    target = LoRALinear(layers[1], max_loras=1, max_rank=4, ctx=LoRAContext()).target
    assert target.shard_sizes == {**sizes, None: sum(sizes.values())}  # the checkpoint's
    assert target.input_size == 16
    for layer in layers:
        expected = _loaded_delta(layer, {s: (b @ a) for s, (a, b) in pairs.items()})
        torch.testing.assert_close(_rank_delta(layer, pairs).float(), expected)


def test_fused_whole_qkv_and_gate_up_are_cut_per_slice():
    """Phi-3's ``qkv_proj`` / ``gate_up_proj``: one B for all slices, each rank keeps each
    slice's rows of it."""
    qkv = _rank_layers(lambda r: QKVParallelLinear(16, 4, 4, 2, tp_rank=r, tp_size=TP))
    a, b = _pair(16 + 8 + 8, 16)
    full = b @ a
    for layer in qkv:
        expected = _loaded_delta(layer, {"q": full[:16], "k": full[16:24], "v": full[24:]})
        torch.testing.assert_close(_rank_delta(layer, {None: (a, b)}).float(), expected)
    mlp = _rank_layers(lambda r: MergedColumnParallelLinear(16, [12, 12], tp_rank=r,
                                                            tp_size=TP))
    a, b = _pair(24, 16)
    full = b @ a
    for layer in mlp:
        expected = _loaded_delta(layer, {0: full[:12], 1: full[12:]})
        torch.testing.assert_close(_rank_delta(layer, {None: (a, b)}).float(), expected)


def test_row_parallel_keeps_b_whole_and_splits_a():
    layers = _rank_layers(lambda r: RowParallelLinear(32, 16, tp_rank=r, tp_size=TP))
    a, b = _pair(16, 32)
    wrapped = LoRALinear(layers[0], max_loras=1, max_rank=4, ctx=LoRAContext())
    assert wrapped.target.input_size == 32 and wrapped.target.shard_sizes == {None: 16}
    parts = []
    for layer in layers:
        expected = _loaded_delta(layer, {None: b @ a})
        got = _rank_delta(layer, {None: (a, b)}).float()
        torch.testing.assert_close(got, expected)
        parts.append(got)
    torch.testing.assert_close(torch.cat(parts, dim=1), b @ a)  # the ranks' columns: all of A
