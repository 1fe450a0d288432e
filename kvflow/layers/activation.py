"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu_native import native_kernels_for
from kvflow.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """SwiGLU gate (Shazeer 2020): x [T, 2*I] -> silu(x[:, :I]) * x[:, I:] of shape [T, I]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch, any leading shape."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The native C kernel for 2-D rows with a unit-stride last dim (torch's rounding)."""
        native = native_kernels_for(x)
        if native is None or x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x)
        return native.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """One Triton kernel (:func:`kvflow.kernels.activation.silu_and_mul`)."""
        from kvflow.kernels.activation import silu_and_mul

        return silu_and_mul(x)


class GeluAndMul(CustomOp):
    """GeGLU gate (Shazeer 2020; Gemma uses the tanh approximation of GELU):
    x [T, 2*I] -> gelu(x[:, :I]) * x[:, I:] of shape [T, I].

    Args:
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU).
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch on every device (no GeGLU kernel yet)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
