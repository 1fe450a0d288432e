"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.kernels.cpu_native import native_kernels_for
from kvflow.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    ``forward(x, residual)`` with a residual returns ``(norm(x + residual), x + residual)``, the
    pre-norm transformer's fused add-and-norm. x (and residual): [..., hidden]; the kernels
    take [T, hidden] rows, other shapes run :meth:`forward_native`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain torch (HF ``LlamaRMSNorm`` rounding); inputs untouched."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The native C kernel (one pass; fresh outputs) when it takes the operands."""
        native = native_kernels_for(x)
        if native is None or not self._rows_ok(x, residual):
            return self.forward_native(x, residual)
        return native.rms_norm(x, self.weight, self.eps, residual)

    def _rows_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether the native CPU kernel takes these operands: 2-D unit-stride rows, one dtype."""
        dtype = x.dtype
        return x.dim() == 2 and self.weight.dtype == dtype and x.stride(-1) == 1 and (
            residual is None or (residual.stride(-1) == 1 and residual.dtype == dtype
                                 and residual.shape == x.shape))

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One fused Triton kernel for [T, hidden] rows; with a residual, updates x and
        residual in place."""
        if x.dim() != 2:
            return self.forward_native(x, residual)
        from kvflow.kernels.norm import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, cast to
    x's dtype at the end (the checkpoint stores ``weight`` as an offset from 1).

    ``forward(x, residual)`` with a residual returns ``(norm(x + residual), x + residual)``.
    Works on any leading shape (``[T, hidden]`` or per-head ``[T, H, head_dim]``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain torch on every device (no kernel rounds like Gemma's fp32 ``(1 + w)``)."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
