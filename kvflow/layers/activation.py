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
        """Plain torch, any leading shape (GPUs, and CPU with ``KVFLOW_NATIVE_CPU=0``)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The native C kernel (``csrc/cpu_gelu.c``: fp32 math, torch's rounding points) for
        2-D rows with a unit-stride last dim, so CPU step graphs can record it."""
        native = native_kernels_for(x)
        if native is None or x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x)
        return native.gelu_and_mul(x, self.approximate)


# HF ``hidden_act`` names of the gated MLPs kvflow runs -> (gate activation, GELU approximation)
_GATED_ACTIVATIONS = {"silu": ("silu", None), "swish": ("silu", None),
                      "gelu": ("gelu", "none"), "gelu_pytorch_tanh": ("gelu", "tanh"),
                      "gelu_new": ("gelu", "tanh")}


def gated_activation(hidden_act: str | None, field: str = "hidden_act") -> CustomOp:
    """The gated MLP activation for an HF config's activation name: SwiGLU for ``silu`` /
    ``swish`` (and ``None``, every Llama-family default), GeGLU for ``gelu`` (erf) and
    ``gelu_pytorch_tanh`` / ``gelu_new`` (the tanh approximation).

    Args:
        hidden_act: the config's value.
        field: the config field it came from, for the error.

    Raises:
        ValueError: naming ``field`` for any other activation (computing it as SiLU would give
            wrong numbers silently).
    """
    kind, approximate = _GATED_ACTIVATIONS.get(hidden_act or "silu", (None, None))
    if kind is None:
        raise ValueError(f"{field}={hidden_act!r} is not supported; kvflow's gated MLPs run "
                         f"{sorted(_GATED_ACTIVATIONS)}")
    return SiluAndMul() if kind == "silu" else GeluAndMul(approximate)


def require_silu(hidden_act: str | None, what: str, field: str = "hidden_act") -> None:
    """Refuse a non-SiLU activation where kvflow only has SwiGLU (the fused MoE experts).

    Raises:
        ValueError: naming ``field`` and ``what`` when ``hidden_act`` is not ``silu`` /
            ``swish`` (or unset).
    """
    if (hidden_act or "silu") not in ("silu", "swish"):
        raise ValueError(f"{field}={hidden_act!r} is not supported for {what}: kvflow's MoE "
                         "experts compute SwiGLU (silu) only")
