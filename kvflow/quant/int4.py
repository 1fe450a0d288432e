"""Weight-only INT4 (W4A16), group-wise asymmetric: each group of ``group_size`` consecutive
input weights of one output row has its own scale and zero point.

Per group: ``s = (max - min) / 15``, ``q = round((w - min) / s)`` in [0, 15], and
``w ~= (q - 8) * s + z`` with ``z = min + 8 s`` -- the "tinygemm" convention of torch's
``_weight_int4pack_mm*`` kernels (and torchao's int4 weight-only layout), so the CPU path is
torch's ``_weight_int4pack_mm_for_cpu`` on weights packed once by
``_convert_weight_to_int4pack_for_cpu``. Where that kernel cannot take the shape (it needs
``N % 16 == 0`` and ``K % group_size == 0``) or on other devices, the reference dequantizes
the nibbles and runs a plain GEMM.

Group 32 (llama.cpp's Q4 block) is the default; 128 (torchao's default) halves the scale
overhead at some accuracy cost (``--quantization-group-size``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.quant.base import LinearMethod

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization per group of ``group_size`` input columns.

    Args:
        weight: [N, K] float, ``K % group_size == 0``.
        group_size: columns per group.

    Returns:
        (q int32 [N, K] in [0, 15], scale float32 [N, K // group_size],
        zero float32 [N, K // group_size]) with ``w ~= (q - 8) * scale + zero`` per group.

    Raises:
        ValueError: when ``K`` is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4: input size {k} is not a multiple of group size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.view(n, k), scale, lo + 8.0 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 from ``q`` [N, K] (values 0..15) and per-group ``scale``/``zero``
    [N, K // G]: ``(q - 8) * scale + zero``."""
    n, groups = scale.shape
    w = (q.view(n, groups, -1).float() - 8.0) * scale[..., None] + zero[..., None]
    return w.view(n, -1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] in 0..15 (K even) -> uint8 [N, K / 2], low nibble first."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)


class Int4WeightOnlyMethod(LinearMethod):
    """After loading: ``weight`` uint8 (torch's CPU int4 pack, or nibble pairs [N, K/2]) and
    ``weight_scales_and_zeros`` float [K // G, N, 2] (the kernel's layout).

    Args:
        group_size: input columns per scale/zero pair.
    """

    name = "int4"

    def __init__(self, group_size: int = 32) -> None:
        super().__init__()
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Raises:
            ValueError: when ``group_size`` does not divide ``input_size`` (this rank's input
                columns: a row-parallel layer's are split over the tensor-parallel ranks),
                before any weight is read.
        """
        if input_size % self.group_size:
            tp = getattr(layer, "tp_size", 1) if getattr(layer, "tp_dim", None) == 1 else 1
            where = (f"the {input_size} input columns each of tensor_parallel_size={tp} ranks "
                     f"holds of a {input_size * tp}-column layer (groups never straddle "
                     "ranks)") if tp > 1 else f"a layer's {input_size} input columns"
            raise ValueError(f"int4: quantization_group_size={self.group_size} does not "
                             f"divide {where}; use a group size that divides {input_size}")
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                    requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        n, k = weight.shape
        q, scale, zero = quantize_int4_groupwise(weight, self.group_size)
        dtype = weight.dtype if weight.dtype in _CPU_DTYPES else torch.float32
        # torch's CPU int4 kernel only for 16-bit models: its fp32 path is scalar in torch 2.13
        # (1536 x 576, one thread: 1.7 ms at 1 row and 800 ms at 512 rows, against 0.08 / 11
        # ms in bf16); fp32 models keep nibble pairs and widen them for the fp32 GEMM.
        layer.int4_cpu_packed = weight.device.type == "cpu" and n % 16 == 0 and k % 2 == 0 \
            and weight.dtype in (torch.bfloat16, torch.float16)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1) if layer.int4_cpu_packed \
            else _pack_nibbles(q)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.weight_scales_and_zeros = nn.Parameter(
            torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous(),
            requires_grad=False)
        layer.int4_shape = (n, k)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        sz = layer.weight_scales_and_zeros.float()
        q = self._nibbles(layer)
        w = dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t()).to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def apply_cpu(self, layer: nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        if not layer.int4_cpu_packed or x.dtype not in _CPU_DTYPES:
            return self.apply_native(layer, x, bias)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(rows, layer.weight, self.group_size,
                                              layer.weight_scales_and_zeros.to(x.dtype))
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _nibbles(self, layer: nn.Module) -> torch.Tensor:
        """The 4-bit values as uint8 [N, K] (from either storage layout)."""
        if not layer.int4_cpu_packed:
            return _unpack_nibbles(layer.weight.data)
        # torch's CPU pack: recover through the kernel itself (identity activations).
        _, k = layer.int4_shape
        sz = layer.weight_scales_and_zeros.float()
        ones = torch.stack([torch.ones_like(sz[..., 0]), torch.full_like(sz[..., 0], 8.0)], -1)
        eye = torch.eye(k, dtype=torch.float32)
        w = torch._weight_int4pack_mm_for_cpu(eye, layer.weight, self.group_size, ones)
        return w.t().round().to(torch.uint8)
