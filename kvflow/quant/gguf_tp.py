"""Tensor-parallel slices of GGUF tensors kept as GGML blocks (``--quantization gguf`` with
``--tensor-parallel-size`` > 1), cut the way vLLM shards the float weights: a column-parallel
layer (q/k/v, gate/up, an expert's w1/w3) keeps its rank's output rows, which are whole GGML
rows (free); a row-parallel layer (o_proj, down_proj, an expert's w2) keeps its rank's input
columns, which are whole blocks only when the rank's width is a multiple of the type's block
(32 elements for Q4_0/Q4_1/Q5_0/Q8_0, 256 for Q4_K/Q5_K/Q6_K); a vocabulary table keeps its
rank's rows, the last rank's padded with zero blocks (they dequantize to 0).

Kept tensors are uint8 ``[rows, row_bytes]`` blocks of a GGML type, or float32 ``[rows, cols]``
(type ``F32``). Every slice is a copy, so a rank holds only its own bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, F32, TYPE_NAMES


def rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows ``[start, start + size)`` of a kept tensor (a contiguous copy)."""
    return tensor.narrow(0, start, size).clone(memory_format=torch.contiguous_format)


def columns(tensor: torch.Tensor, ggml_type: int, rank: int, tp_size: int,
            what: str, dim_name: str) -> torch.Tensor:
    """TP rank ``rank``'s share of the input columns of a kept tensor: elements
    ``[rank * K / tp_size, (rank + 1) * K / tp_size)`` of every row, as whole blocks.

    Args:
        tensor: uint8 blocks [N, row_bytes] of ``ggml_type``, or float32 [N, K] (``F32``).
        what / dim_name: the weight and the config size it splits, for the error.

    Raises:
        ValueError: naming the type, its block size and the split when ``K / tp_size`` is
            not a multiple of the block size (a block would be cut in two).
    """
    if ggml_type == F32:
        width = tensor.shape[1] // tp_size
        return tensor.narrow(1, rank * width, width).clone(
            memory_format=torch.contiguous_format)
    block, block_bytes = BLOCK_SHAPES[ggml_type]
    full = tensor.shape[1] // block_bytes * block
    if full % (tp_size * block):
        raise ValueError(
            f"GGUF {what} ({TYPE_NAMES.get(ggml_type, ggml_type)}, blocks of {block} "
            f"elements) cannot be split by columns over tensor_parallel_size {tp_size}: "
            f"{dim_name} {full} / {tp_size} = {full / tp_size:g} is not a multiple of "
            f"{block}; use fewer ranks or --quantization none (dequantized at load)")
    width = full // tp_size // block * block_bytes
    return tensor.narrow(1, rank * width, width).clone(memory_format=torch.contiguous_format)


def linear_rows(layer: nn.Module, shard_id: object) -> tuple[int, int]:
    """(first row, rows) of TP rank ``layer.tp_rank``'s part of the full checkpoint tensor
    ``shard_id`` of a column-parallel layer (``kvflow.layers.linear``): q/k/v heads (KV heads
    replicated when there are fewer than ranks), a merged layer's sub-projection, or the
    plain layer's ``output_size_per_partition`` rows."""
    if shard_id in ("q", "k", "v"):
        if shard_id == "q":
            size = layer.num_heads * layer.head_dim
            return layer.tp_rank * size, size
        size = layer.num_kv_heads * layer.head_dim
        return layer.tp_rank // layer.num_kv_replicas * size, size
    if shard_id is not None:  # MergedColumnParallelLinear's sub-projection index
        size = layer.output_sizes[shard_id] // layer.tp_size
        return layer.tp_rank * size, size
    size = layer.output_size_per_partition
    return layer.tp_rank * size, size


def shard_linear(layer: nn.Module, shard_id: object, tensor: torch.Tensor,
                 ggml_type: int) -> torch.Tensor:
    """This TP rank's part of one full kept checkpoint tensor of a linear layer: rows for a
    column-parallel layer (``tp_dim`` 0), whole-block columns for a row-parallel one
    (``tp_dim`` 1, see :func:`columns`), all of it for a replicated one.

    Raises:
        ValueError: from :func:`columns`.
    """
    if layer.tp_size == 1 or layer.tp_dim is None:
        return tensor
    if layer.tp_dim == 0:
        return rows(tensor, *linear_rows(layer, shard_id))
    return columns(tensor, ggml_type, layer.tp_rank, layer.tp_size,
                   f"weight of a row-parallel {type(layer).__name__}", "input size")


def vocab_rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows ``[start, start + size)`` of a vocabulary table, zero rows past its end (the
    last rank's padding: zero blocks dequantize to 0)."""
    out = tensor.new_zeros(size, tensor.shape[1])
    part = tensor[start:start + size]
    out[:part.shape[0]] = part
    return out
