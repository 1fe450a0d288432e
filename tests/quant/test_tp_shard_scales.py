"""Scales quantized on load are the same on a tensor-parallel rank as in one process: each rank
of a row-parallel INT8 layer (and of the experts' down projection) takes its rows' absmax over
the full checkpoint row, and FP8 takes every checkpoint tensor's absmax over the whole tensor,
not over the rank's shard. A pre-quantized (compressed-tensors) channel-wise checkpoint's
scales go with their rows.

Oracle: the quantization rules written out here (INT8 absmax/127 per row, FP8 absmax/448 per
tensor, e4m3 casts) applied to the full weight (per expert for MoE layers), then sliced as the ranks slice it. No worker
process: each rank's layer is built with its ``tp_rank`` and loaded as its worker loads it.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.layers.moe import FusedMoE
from kvflow.quant.fp8 import Fp8LinearMethod
from kvflow.quant.int8 import Int8WeightOnlyMethod
from kvflow.quant.moe import Fp8FusedMoEMethod, Int8FusedMoEMethod

TP = 2


def int8_dequant(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().max(dim=1).values / 127
    return torch.round(w / s[:, None]).clamp(-127, 127) * s[:, None]


def fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().max() / 448
    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _row_parallel_ranks(method_cls, w: torch.Tensor) -> list[RowParallelLinear]:
    ranks = []
    for rank in range(TP):
        layer = RowParallelLinear(w.shape[1], w.shape[0], tp_rank=rank, tp_size=TP)
        layer.set_quant_method(method_cls())
        layer.weight.weight_loader(layer.weight, w)  # the worker hands every rank the full row
        layer.quant_method.process_weights_after_loading(layer)
        ranks.append(layer)
    return ranks


def _dequant(layer) -> torch.Tensor:
    return layer.weight.float() * layer.weight_scale[:, None]


def test_row_parallel_int8_shards_use_the_full_rows_scale():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=gen)
    w[:, 20] *= 8  # the largest value of each row sits in rank 1's half
    ranks = _row_parallel_ranks(Int8WeightOnlyMethod, w)
    torch.testing.assert_close(torch.cat([_dequant(r) for r in ranks], dim=1), int8_dequant(w),
                               rtol=0, atol=1e-6)
    for layer in ranks:
        assert not hasattr(layer, "_load_absmax")  # the note is consumed
    x = torch.randn(3, 32, generator=gen)
    partial = [r.quant_method.apply(r, xs) for r, xs in zip(ranks, x.chunk(TP, dim=1))]
    torch.testing.assert_close(sum(partial), x @ int8_dequant(w).T, rtol=1e-5, atol=1e-5)


def test_fp8_shards_use_the_whole_tensors_scale():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 32, generator=gen)
    w[3, 25] = 9.0  # the absmax in rank 1's columns
    ranks = _row_parallel_ranks(Fp8LinearMethod, w)
    for layer in ranks:
        torch.testing.assert_close(layer.weight_scale, (w.abs().max() / 448).expand(24))
    torch.testing.assert_close(torch.cat([_dequant(r) for r in ranks], dim=1), fp8_tensor(w),
                               rtol=0, atol=1e-6)
    parts = {"q": torch.randn(32, 32, generator=gen), "k": torch.randn(16, 32, generator=gen),
             "v": torch.randn(16, 32, generator=gen)}
    parts["q"][30, 0] = parts["k"][12, 1] = 7.0  # in rank 1's heads of q and of k
    for rank in range(TP):
        layer = QKVParallelLinear(32, head_dim=8, num_heads=4, num_kv_heads=2, tp_rank=rank,
                                  tp_size=TP)
        layer.set_quant_method(Fp8LinearMethod())
        for shard, t in parts.items():
            layer.weight.weight_loader(layer.weight, t, shard)
        layer.quant_method.process_weights_after_loading(layer)
        want = torch.cat([fp8_tensor(t).chunk(TP)[rank] for t in parts.values()])
        torch.testing.assert_close(_dequant(layer), want, rtol=0, atol=1e-6)


def _moe_dequant(layer, which: str) -> torch.Tensor:
    return getattr(layer, f"{which}_weight").float() * \
        getattr(layer, f"{which}_weight_scale")[..., None]


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_tensor_parallel_experts_use_the_full_tensors_scales(scheme, stacked):
    """FusedMoE split by width (TP, no EP): INT8 rows of the down projection and FP8 gate/up/
    down tensors of every expert are scaled as one process scales them."""
    experts, hidden, inter = 3, 16, 32
    gen = torch.Generator().manual_seed(2)
    w1, w3 = torch.randn(experts, inter, hidden, generator=gen), \
        torch.randn(experts, inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    w1[:, -1, 0] = w3[:, -1, 1] = w2[:, :, -1] = 6.0  # the extremes sit in rank 1's half
    rnd = {"int8": int8_dequant, "fp8": fp8_tensor}[scheme]
    method = {"int8": Int8FusedMoEMethod, "fp8": Fp8FusedMoEMethod}[scheme]
    rounded = {  # int8: per row of each expert; fp8: per expert tensor
        "w1": torch.stack([rnd(w) for w in w1]), "w3": torch.stack([rnd(w) for w in w3]),
        "w2": torch.stack([rnd(w) for w in w2])}
    for rank in range(TP):
        layer = FusedMoE(experts, 2, hidden, inter, renormalize=False, tp_rank=rank,
                         tp_size=TP)
        layer.set_quant_method(method())
        if stacked:
            layer.weight_loader(layer.w13_weight, torch.cat([w1, w3], dim=1), "w13")
            layer.weight_loader(layer.w2_weight, w2, "w2")
        else:
            for e in range(experts):
                layer.weight_loader(layer.w13_weight, w1[e], "w1", e)
                layer.weight_loader(layer.w13_weight, w3[e], "w3", e)
                layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
        layer.quant_method.process_weights_after_loading(layer)
        part = slice(rank * inter // TP, (rank + 1) * inter // TP)
        want13 = torch.cat([rounded["w1"][:, part], rounded["w3"][:, part]], dim=1)
        torch.testing.assert_close(_moe_dequant(layer, "w13"), want13, rtol=0, atol=1e-6)
        torch.testing.assert_close(_moe_dequant(layer, "w2"), rounded["w2"][:, :, part],
                                   rtol=0, atol=1e-6)
        assert not hasattr(layer, "_load_absmax")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_prequantized_channel_scales_shard_with_their_rows(scheme):
    """A compressed-tensors checkpoint's channel-wise weight (float8_e4m3fn or int8 [N, K] with
    a float32 ``weight_scale`` [N, 1]) at TP=2: a row-parallel rank takes its columns and every
    row's scale, a column-parallel rank of gate/up its rows and their scales. (The FP8 [N, 1]
    scale was cut by column like the weight: rank 1 of o_proj/down_proj failed to load,
    'start (1) + length (1) exceeds dimension size (1)'.)"""
    gen = torch.Generator().manual_seed(3)
    if scheme == "fp8":
        def method():
            return Fp8LinearMethod(prequantized=True, weight_strategy="channel",
                                   quantize_input=False)
        stored = torch.float8_e4m3fn
    else:
        def method():
            return Int8WeightOnlyMethod(prequantized=True)
        stored = torch.int8

    def checkpoint(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(-100, 101, (rows, cols), generator=gen).to(stored)
        return q, torch.rand(rows, 1, generator=gen) + 0.5

    def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return q.float() * s

    wq, ws = checkpoint(24, 32)
    x = torch.randn(3, 32, generator=gen)
    partial = []
    for rank, xs in zip(range(TP), x.chunk(TP, dim=1)):
        layer = RowParallelLinear(32, 24, tp_rank=rank, tp_size=TP)
        layer.set_quant_method(method())
        layer.weight.weight_loader(layer.weight, wq)
        layer.weight_scale.weight_loader(layer.weight_scale, ws)
        layer.quant_method.process_weights_after_loading(layer)
        torch.testing.assert_close(_dequant(layer), dequant(wq, ws).chunk(TP, dim=1)[rank],
                                   rtol=0, atol=0)
        partial.append(layer.quant_method.apply(layer, xs))
    torch.testing.assert_close(sum(partial), x @ dequant(wq, ws).T, rtol=1e-5, atol=1e-4)
    gate, up = checkpoint(16, 32), checkpoint(16, 32)
    for rank in range(TP):
        layer = MergedColumnParallelLinear(32, [16, 16], tp_rank=rank, tp_size=TP)
        layer.set_quant_method(method())
        for shard, (q, s) in enumerate((gate, up)):
            layer.weight.weight_loader(layer.weight, q, shard)
            layer.weight_scale.weight_loader(layer.weight_scale, s, shard)
        layer.quant_method.process_weights_after_loading(layer)
        want = torch.cat([dequant(q, s).chunk(TP)[rank] for q, s in (gate, up)])
        torch.testing.assert_close(_dequant(layer), want, rtol=0, atol=0)
