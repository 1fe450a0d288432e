"""The one GEMM every projection calls, with a fast path for 16-bit models on CPUs without
16-bit matmul units.

A bf16 (or fp16) GEMM multiplies 16-bit operands and accumulates in fp32, then rounds the result
to 16 bits. Widening a bf16 or fp16 value to fp32 is exact, so running the same product on the
fp32 FMA units gives the same mathematical result (only the summation order differs, as between
any two GEMM libraries). On x86 CPUs without AVX512-BF16/AMX (for example AVX2-only AMD EPYC),
torch's native bf16 GEMM runs 6-10x slower than its fp32 GEMM; widening is the fast way there.
llama.cpp takes the same route for bf16 tensors on CPUs without bf16 dot products.

Weights stay stored in 16 bits (the memory a user chose); they are widened per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           widen_to_fp32: bool = False) -> torch.Tensor:
    """``y = x @ weight.T + bias``.

    Args:
        x: [..., K] activations.
        weight: [N, K], same dtype as ``x``.
        bias: [N] or None.
        widen_to_fp32: run a bf16/fp16 product on fp32 units (exact widening, fp32
            accumulation) and round the result back to ``x.dtype``. Ignored for fp32 inputs.

    Returns:
        [..., N] in ``x.dtype``.
    """
    if not widen_to_fp32 or x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)


class WidenedGemmMixin:
    """Modules whose GEMMs go through :func:`linear` carry this switch (off by default)."""

    widen_to_fp32: bool = False


def widen_half_gemms(model: nn.Module) -> int:
    """Turn on fp32-unit GEMMs in every module of ``model`` that supports them.

    Called once after loading, when the platform lacks native matmuls for the model dtype
    (:meth:`kvflow.platforms.base.Platform.has_native_matmul`). Returns the number of modules
    switched.
    """
    switched = 0
    for module in model.modules():
        if isinstance(module, WidenedGemmMixin):
            module.widen_to_fp32 = True
            switched += 1
    return switched
