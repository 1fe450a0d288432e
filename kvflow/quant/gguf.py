"""GGUF weights kept quantized: a linear or vocabulary layer holds the file's raw GGML blocks
(uint8 ``[rows, row_bytes]``, exactly as stored) and dequantizes them tile by tile inside its
GEMM, so memory holds ~4.5-6.5 bits per weight instead of 16 or 32 (``--dtype`` sets only the
activation type).

The GEMM (:func:`gguf_linear`) walks the output rows in tiles of at most ``TILE_ELEMENTS``
weights: each tile is dequantized to fp32 (:mod:`kvflow.kernels.gguf_dequant`, plain torch,
any device) and multiplied at once, so the widened copy never exceeds one tile (32 MB).
On CPU (:func:`gguf_linear_cpu`) kvflow's native kernel (``kernels/csrc/cpu_gguf.c``) runs
instead: up to ``NATIVE_GEMM_MAX_ROWS`` activation rows (decode) it dequantizes each block in
registers inside the dot products; for more rows (prefill) it dequantizes tiles natively and
torch's GEMM multiplies them. ``KVFLOW_CPU_GGUF=torch`` keeps the plain-torch path.
Embedding lookups dequantize only the rows they gather. Fused layers whose checkpoint shards
have different GGML types (a Q4_K_M file's q/k Q4_K beside v Q6_K) keep one block tensor per
shard and run one GEMM each. Tensors the file stores as floats (F32/F16/BF16) stay floats.
With tensor parallelism each rank keeps its slice of the blocks (:mod:`kvflow.quant.gguf_tp`:
whole rows, or input columns in whole blocks where the rank's width allows).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.config import cpu_gguf_choice
from kvflow.kernels.cpu_native import NativeCpuKernels, native_cpu_kernels
from kvflow.kernels.gguf_dequant import F32, dequantize_rows
from kvflow.quant.base import EmbeddingMethod, LinearMethod
from kvflow.quant.gguf_tp import shard_linear, vocab_rows

TILE_ELEMENTS = 1 << 23  # weights dequantized per tile (32 MB of fp32)
NATIVE_GEMM_MAX_ROWS = 16  # activation rows up to which the fused native kernel runs


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [R, K] of a kept tensor (``F32``: a float tensor, returned as float32)."""
    return raw.float() if ggml_type == F32 else dequantize_rows(raw, ggml_type)


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` in fp32 with W kept as GGML blocks ``raw`` [N, row_bytes].

    Args:
        x: float32 [M, K].
        raw: the blocks (or, for ``F32``, the float weight [N, K]).
        ggml_type: a GGML type id.
        out: optional float32 [M, N] to write into.

    Returns:
        float32 [M, N].
    """
    n = raw.shape[0]
    k = x.shape[-1]
    out = x.new_empty(x.shape[0], n, dtype=torch.float32) if out is None else out
    rows = max(1, TILE_ELEMENTS // max(1, k))
    for start in range(0, n, rows):
        tile = dequantize(raw[start:start + rows], ggml_type)
        torch.mm(x, tile.t(), out=out[:, start:start + rows])
    return out


def gguf_linear_cpu(x: torch.Tensor, raw: torch.Tensor, ggml_type: int,
                    kernels: NativeCpuKernels) -> torch.Tensor:
    """:func:`gguf_linear` on kvflow's native CPU kernels (same contract): the fused
    dequantize-and-dot kernel up to ``NATIVE_GEMM_MAX_ROWS`` rows, native tile dequantization
    and torch's GEMM above (where the GEMM's blocking beats dot products)."""
    if ggml_type == F32:
        return torch.mm(x, raw.t())
    k, n = x.shape[-1], raw.shape[0]
    if x.shape[0] <= NATIVE_GEMM_MAX_ROWS:
        return kernels.gguf_gemm(x, raw, ggml_type, k)
    out = x.new_empty(x.shape[0], n)
    rows = max(1, TILE_ELEMENTS // max(1, k))
    for start in range(0, n, rows):
        tile = kernels.gguf_dequantize(raw[start:start + rows], ggml_type, k)
        torch.mm(x, tile.t(), out=out[:, start:start + rows])
    return out


def gguf_cpu_kernels() -> NativeCpuKernels | None:
    """kvflow's native CPU kernels unless ``KVFLOW_CPU_GGUF=torch`` or they cannot be built."""
    return native_cpu_kernels() if cpu_gguf_choice() == "native" else None


def as_kept(loaded: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(storage, ggml type) of a checkpoint tensor: raw blocks tagged by the GGUF loader, or a
    float tensor kept as float32 (type ``F32``)."""
    ggml_type = getattr(loaded, "ggml_type", None)
    if ggml_type is None:
        return loaded.float().contiguous(), F32
    return loaded.contiguous(), int(ggml_type)


class GGUFLinearMethod(LinearMethod):
    """After loading: ``weight`` (one block tensor [N, row_bytes], or ``weight_0..`` per shard
    when shards differ in type) with its GGML type in ``layer.gguf_types``."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.gguf_shards = {}

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard: Any) -> None:
        """Keep one shard's blocks as they are (placed in row order after loading); with
        tensor parallelism this rank's rows or whole-block columns of them
        (:func:`kvflow.quant.gguf_tp.shard_linear`).

        Raises:
            ValueError: for a row-parallel split that would cut blocks.
        """
        shard_id = shard[0] if shard else None
        tensor, ggml_type = as_kept(loaded)
        layer.gguf_shards[shard_id] = (shard_linear(layer, shard_id, tensor, ggml_type),
                                       ggml_type)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [layer.gguf_shards.pop(s) for s in layer.shard_ids if s in layer.gguf_shards]
        types = [t for _, t in parts]
        if len(set(types)) == 1 and len({p.shape[1] for p, _ in parts}) == 1:
            parts = [(torch.cat([p for p, _ in parts]) if len(parts) > 1 else parts[0][0],
                      types[0])]
        names = ["weight"] if len(parts) == 1 else [f"weight_{i}" for i in range(len(parts))]
        del layer.weight
        for name, (tensor, _) in zip(names, parts):
            setattr(layer, name, nn.Parameter(tensor, requires_grad=False))
        layer.gguf_types = tuple(types if len(parts) > 1 else types[:1])
        layer._quant_param_names = tuple(names)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None,
                     kernels: NativeCpuKernels | None = None) -> torch.Tensor:
        """Plain torch (``kernels`` None) or the native CPU kernels."""
        rows = x.reshape(-1, x.shape[-1]).float()
        outs = [gguf_linear(rows, getattr(layer, name), t) if kernels is None
                else gguf_linear_cpu(rows, getattr(layer, name), t, kernels)
                for name, t in zip(layer._quant_param_names, layer.gguf_types)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def apply_cpu(self, layer: nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """The native kernels (:func:`gguf_linear_cpu`) where available."""
        return self.apply_native(layer, x, bias, gguf_cpu_kernels())


class GGUFEmbeddingMethod(EmbeddingMethod):
    """A vocabulary table kept as GGML blocks: ``weight`` [vocab, row_bytes] (type in
    ``weight.ggml_type``, so a tied LM head sharing the parameter knows it too)."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Keep the table's blocks; with tensor parallelism this rank's vocabulary rows
        (``shard_size`` of them from ``vocab_start``, zero blocks past the vocabulary)."""
        tensor, ggml_type = as_kept(loaded)
        if layer.tp_size > 1:
            tensor = vocab_rows(tensor, layer.vocab_start, layer.shard_size)
        param.data = tensor
        param.ggml_type = ggml_type  # type: ignore[attr-defined]

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raw = layer.weight[ids]
        return dequantize(raw, layer.weight.ggml_type).to(layer.params_dtype)

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        kernels = gguf_cpu_kernels() if x.device.type == "cpu" else None
        if kernels is not None:
            return gguf_linear_cpu(x, layer.weight, layer.weight.ggml_type, kernels)
        return gguf_linear(x, layer.weight, layer.weight.ggml_type)
