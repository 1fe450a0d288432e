"""Which part of a LoRA adapter's A and B one tensor-parallel rank holds.

An adapted layer computes ``y = x W^T + (x A^T) B^T`` (``A [r, in]``, ``B [out, r]``, the
scaling folded into B). Each rank shards the LoRA pair the way its base weight ``W`` is
sharded, so that the delta lands in the rank's own output rows or partial sums (as vLLM does):

* **column-parallel** (q/k/v, gate/up, fused or not; ``tp_dim == 0``): the rank holds all of
  ``x``, so it keeps A whole and the rows of B that match its rows of ``W``: per fused slice
  (q, k, v; gate, up), the slice's rows of this rank, a replicated KV head's rows on every rank
  that holds it. An adapter of the fused layer as a whole (Phi-3's ``qkv_proj``) is cut into
  the same slices first.
* **row-parallel** (o_proj, down_proj; ``tp_dim == 1``): the rank holds its columns
  ``x_r`` of ``x`` and computes a partial sum that the layer all-reduces. It keeps the matching
  columns ``A_r`` of A and all of B: ``sum_r (x_r A_r^T) B^T = (x A^T) B^T``, so a delta added
  to the partial sum before the all-reduce is counted exactly once.
* **replicated** (``tp_dim is None``): every rank keeps the whole pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvflow.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear


@dataclass(frozen=True)
class SliceRows:
    """One fused slice of a layer's output rows.

    Attributes:
        full: its rows in the checkpoint (all ranks together).
        start: the first of this rank's rows within those ``full`` rows.
        size: this rank's rows of it.
    """

    full: int
    start: int
    size: int


def slice_rows(layer: LinearBase) -> dict[Any, SliceRows]:
    """Each fused slice's rows (checkpoint and this rank's), by shard id in row order;
    ``{None: ...}`` for an unfused layer."""
    rank, tp = layer.tp_rank, layer.tp_size
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        kv_rank = rank // layer.num_kv_replicas  # a replicated KV head: its owner's rows
        return {"q": SliceRows(layer.total_num_heads * layer.head_dim, rank * q, q),
                "k": SliceRows(layer.total_num_kv_heads * layer.head_dim, kv_rank * kv, kv),
                "v": SliceRows(layer.total_num_kv_heads * layer.head_dim, kv_rank * kv, kv)}
    if isinstance(layer, MergedColumnParallelLinear):
        return {i: SliceRows(full, rank * (full // tp), full // tp)
                for i, full in enumerate(layer.output_sizes)}
    out = layer.output_size_per_partition
    if layer.tp_dim == 0:
        return {None: SliceRows(out * tp, rank * out, out)}
    return {None: SliceRows(out, 0, out)}


def full_input_size(layer: LinearBase) -> int:
    """The layer's input features in the checkpoint (a row-parallel rank holds a part)."""
    if layer.tp_dim == 1:
        return layer.input_size_per_partition * layer.tp_size
    return layer.input_size_per_partition


def shard_pair(layer: LinearBase, shard: Any, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one checked LoRA pair of ``layer`` (see the module docstring).

    Args:
        layer: the base layer the pair adapts.
        shard: the fused slice the pair adapts (``None``: the whole layer).
        a: [r, full input] A.
        b: [full rows of ``shard`` (all slices for None), r] B, scaling folded in.

    Returns:
        ``(A [r, in_per_rank], B [rows_per_rank, r])``, the given tensors themselves on one
        rank, contiguous copies otherwise (not views keeping the whole pair alive).
    """
    if layer.tp_size == 1:
        return a, b
    if layer.tp_dim == 1:
        cols = layer.input_size_per_partition
        return a.narrow(1, layer.tp_rank * cols, cols).contiguous(), b
    if layer.tp_dim is None:
        return a, b
    slices = slice_rows(layer)
    if shard is not None:
        rows = slices[shard]
        return a, b.narrow(0, rows.start, rows.size).contiguous()
    parts, offset = [], 0  # the fused layer as a whole: each slice's rows of this rank
    for rows in slices.values():
        parts.append(b.narrow(0, offset + rows.start, rows.size))
        offset += rows.full
    return a, torch.cat(parts)
