"""The reference method: the weight is a plain ``[N, K]`` tensor in the model dtype.

Its GEMM is :func:`kvflow.kernels.gemm.linear`, with the CPU fast paths the model runner sets
after loading (fp32 weights packed for kvflow's C GEMM or oneDNN; 16-bit weights widened on
CPUs without 16-bit matmul units).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.gemm import linear
from kvflow.quant.base import EmbeddingMethod, LinearMethod


class UnquantizedLinearMethod(LinearMethod):
    """``weight``: [output_size, input_size] in the model dtype."""

    name = "none"
    uses_gemm_path = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                    requires_grad=False)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed_weight
        if packed is not None:  # no layer.weight look-up (nn.Module.__getattr__: ~1 us a call)
            if bias is not None:  # a 16-bit bias's fp32 copy (worker/cpu_setup.py), if kept
                bias = layer.__dict__.get("bias_fp32", bias)
            return linear(x, None, bias, packed=packed)
        return linear(x, layer.weight, bias, layer.gemm_workspace)


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    """``weight``: [num_embeddings, embedding_dim] in the model dtype."""

    name = "none"
    uses_gemm_path = True

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim,
                                                dtype=params_dtype), requires_grad=False)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if packed is not None and layer.weight.numel() == 0:  # the table lives in a tied head's
            return packed.rows(ids)                            # packed copy (CPU)
        kernels = getattr(layer, "native_kernels", None)  # CPU: one C call (cpu_setup.py)
        if kernels is not None:
            return kernels.embedding(layer.weight, ids)
        return F.embedding(ids, layer.weight)

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, layer.weight, None, layer.gemm_workspace, layer.packed_weight,
                      out_dtype=torch.float32)
