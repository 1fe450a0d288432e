"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.cpu_native import native_kernels_for


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): x [T, 2*I] -> silu(x[:, :I]) * x[:, I:] of shape [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kvflow.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        native = native_kernels_for(x)
        if native is not None and x.dim() == 2 and x.stride(-1) == 1:
            return native.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020; Gemma uses the tanh approximation of GELU):
    x [T, 2*I] -> gelu(x[:, :I]) * x[:, I:] of shape [T, I].

    Args:
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU).
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
