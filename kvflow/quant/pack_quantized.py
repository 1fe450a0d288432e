"""compressed-tensors ``pack-quantized`` weights (llm-compressor's W4A16 / W8A16 presets),
unpacked at load into kvflow's weight-only INT4 and INT8 layouts.

The format (compressed-tensors ``PackedQuantizationCompressor``): per linear layer
``weight_packed`` int32 [N, ceil(K * b / 32)], ``weight_scale`` [N, K // G] (group strategy)
or [N, 1] (channel), ``weight_shape`` = (N, K), and for asymmetric schemes a packed
``weight_zero_point``. Each signed ``b``-bit value ``q`` is stored as ``q + 2^(b-1)``, value
``i`` of a row at bit ``i * b`` (little end first) of the row's words; ``w = q * scale`` of
its group (symmetric).

Runs: symmetric INT4, group (a ``group_size`` dividing the layer's input columns) or channel,
as :class:`~kvflow.quant.int4.Int4WeightOnlyMethod` (its tinygemm convention
``w = (u - 8) * scale + zero`` holds the stored nibble ``u = q + 8`` with ``zero = 0``:
the same values exactly); symmetric INT8 channel as
:class:`~kvflow.quant.int8.Int8WeightOnlyMethod`, and symmetric INT8 group (llm-compressor's
W8A16 preset, group 128) as the same INT8 kernel with the group scales applied inside it. Everything else
(asymmetric zero points, activation ordering / ``g_idx``, other bit widths, quantized
activations) is a ValueError naming the key, before any tensor is read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.cpu_quant import int8_gemm
from kvflow.quant.base import LinearMethod, check_stored_dtype
from kvflow.quant.int4 import Int4WeightOnlyMethod, _pack_nibbles
from kvflow.quant.int8 import Int8WeightOnlyMethod, native_int8_kernels

_KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes torch's CPU int4 kernel takes


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """The stored unsigned values of ``packed`` int32 [N, W], int32 [N, cols] in
    ``[0, 2^num_bits)`` (``q + 2^(num_bits-1)``), for ``num_bits`` 4 or 8 (values never
    straddle a word)."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32) * num_bits
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return vals.reshape(packed.shape[0], -1)[:, :cols]


def pack_quantized_method(scheme: Any, desc: str) -> LinearMethod:
    """The method for a ``pack-quantized`` scheme.

    Raises:
        ValueError: naming the key kvflow does not run (``weights.symmetric``,
            ``weights.actorder``, ``weights.num_bits``, ``weights.strategy``,
            ``weights.type``, ``input_activations``).
    """
    w = scheme.weights
    problems = []
    if w.type != "int":
        problems.append(f"weights.type={w.type!r} (int only)")
    if w.num_bits not in (4, 8):
        problems.append(f"weights.num_bits={w.num_bits} (4 or 8)")
    if not w.symmetric:
        problems.append("weights.symmetric=False (weight_zero_point; symmetric only)")
    if w.actorder is not None:
        problems.append(f"weights.actorder={w.actorder!r} (g_idx; none only)")
    if w.strategy not in ("channel", "group"):
        problems.append(f"weights.strategy={w.strategy!r} (channel or group)")
    if w.dynamic:
        problems.append("weights.dynamic=True")
    if scheme.input_activations is not None:
        problems.append("input_activations (weight-only only)")
    if problems:
        raise ValueError(f"compressed-tensors pack-quantized scheme not supported ({desc}): "
                         + "; ".join(problems))
    group = w.group_size if w.strategy == "group" else None
    return PackedInt8Method(group) if w.num_bits == 8 else PackedInt4Method(group)


def _register(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


def _check_shape(layer: nn.Module, loaded: torch.Tensor, input_size: int) -> None:
    """A ``weight_shape`` (N, K) must give the layer's full input columns.

    Raises:
        ValueError: naming both.
    """
    tp = getattr(layer, "tp_size", 1) if getattr(layer, "tp_dim", None) == 1 else 1
    if loaded.numel() != 2 or int(loaded[1]) != input_size * tp:
        raise ValueError(f"weight_shape {loaded.tolist()} does not give the layer's "
                         f"{input_size * tp} input columns")


def _load_packed(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                 *shard) -> None:
    """Load one pack-quantized tensor: ``weight_shape`` is checked, not placed; a channel
    scale [N, 1] lands as [N]; the others land by rows (and TP columns).

    Raises:
        ValueError: for a ``weight_packed`` not int32 or a ``weight_shape`` that does not
            give the layer's input columns.
    """
    if param is layer.weight_shape:
        _check_shape(layer, loaded, layer.weight_shape[1].item())
        return
    if param is layer.weight_packed:
        check_stored_dtype(param, loaded)
    if param is layer.weight_scale and param.dim() == 1 and loaded.dim() == 2:
        loaded = loaded.reshape(-1)
    layer.weight_loader(param, loaded, *shard)


def _replace(layer: nn.Module, names: tuple[str, ...], drop: tuple[str, ...]) -> None:
    for name in drop:
        delattr(layer, name)
    layer._quant_param_names = names


class PackedInt4Method(Int4WeightOnlyMethod):
    """Symmetric INT4 ``pack-quantized`` weights, run as :class:`Int4WeightOnlyMethod`.

    Args:
        group_size: the checkpoint's input columns per scale; None: one per output channel.
    """

    def __init__(self, group_size: int | None) -> None:
        super().__init__(group_size or 0)
        self.ckpt_group = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Raises:
            ValueError: when ``group_size`` does not divide this rank's input columns.
        """
        group = self.ckpt_group or input_size
        if input_size % group:
            raise ValueError(f"compressed-tensors weights.group_size={group} does not divide "
                             f"a layer's {input_size} input columns (this rank's)")
        _register(layer, "weight_packed", torch.empty(output_size, math.ceil(input_size / 8),
                                                      dtype=torch.int32))
        # a channel scale is [N] here: one per full row, never split by a row-parallel rank
        scale_shape = (output_size, input_size // group) if self.ckpt_group else (output_size,)
        _register(layer, "weight_scale", torch.empty(scale_shape, dtype=torch.float32))
        _register(layer, "weight_shape", torch.tensor([output_size, input_size]))
        self.params_dtype = params_dtype

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard) -> None:
        """``weight_shape`` is checked, not placed; a channel scale [N, 1] lands as [N]; the
        others land by rows (and TP columns).

        Raises:
            ValueError: for a ``weight_packed`` not int32 or a ``weight_shape`` that does not
                give the layer's input columns.
        """
        _load_packed(layer, param, loaded, *shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Unpack to nibbles ``u = q + 8`` and express the scales at the largest group size
        torch's CPU kernel takes that divides the checkpoint's (repeated: the same values),
        zero points 0."""
        n, k = (int(v) for v in layer.weight_shape)
        u = unpack_int32(layer.weight_packed.data, 4, k)
        scale = layer.weight_scale.data.float().reshape(n, -1)
        _replace(layer, ("weight", "weight_scales_and_zeros"),
                 ("weight_packed", "weight_scale", "weight_shape"))
        store_int4(self, layer, u, scale, torch.zeros_like(scale), self.params_dtype)


def store_int4(method: Int4WeightOnlyMethod, layer: nn.Module, u: torch.Tensor,
               scale: torch.Tensor, zero: torch.Tensor, params_dtype: torch.dtype) -> None:
    """Register pre-quantized nibbles as :class:`Int4WeightOnlyMethod` keeps them
    (``w = (u - 8) * scale + zero`` per group), the scales and zeros repeated to the largest
    group size torch's CPU kernel takes that divides the checkpoint's (the same values; none:
    the dequantizing reference at the checkpoint's size). Sets ``method.group_size``.

    Args:
        u: [N, K] integer values 0..15.
        scale, zero: float [N, G], ``K % G == 0``.
        params_dtype: the model dtype (the kernel's scale/zero dtype when 16-bit).
    """
    n, k = u.shape
    group = k // scale.shape[1]
    method.group_size = next((g for g in _KERNEL_GROUPS if group % g == 0), group)
    scale = scale.repeat_interleave(group // method.group_size, dim=1)
    zero = zero.repeat_interleave(group // method.group_size, dim=1)
    dtype = params_dtype if params_dtype in (torch.float32, torch.bfloat16,
                                             torch.float16) else torch.float32
    layer.int4_cpu_packed = u.device.type == "cpu" and n % 16 == 0 \
        and dtype in (torch.bfloat16, torch.float16) and method.group_size in _KERNEL_GROUPS
    weight = torch._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1) \
        if layer.int4_cpu_packed else _pack_nibbles(u)
    _register(layer, "weight", weight)
    _register(layer, "weight_scales_and_zeros", torch.stack(
        [scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
    layer.int4_shape = (n, k)


class PackedInt8Method(Int8WeightOnlyMethod):
    """Symmetric INT8 ``pack-quantized`` weights, run as :class:`Int8WeightOnlyMethod`:
    ``weight`` int8 [N, K]; ``weight_scale`` float32 [N] (channel) or [N, K // G] (group:
    :func:`~kvflow.kernels.cpu_quant.int8_gemm` with the group scales, on CPU).

    Args:
        group_size: the checkpoint's input columns per scale; None: one per output channel.
    """

    def __init__(self, group_size: int | None = None) -> None:
        super().__init__(prequantized=True)
        self.ckpt_group = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Raises:
            ValueError: when ``group_size`` does not divide this rank's input columns.
        """
        if self.ckpt_group and input_size % self.ckpt_group:
            raise ValueError(f"compressed-tensors weights.group_size={self.ckpt_group} does "
                             f"not divide a layer's {input_size} input columns (this rank's)")
        _register(layer, "weight_packed", torch.empty(output_size, math.ceil(input_size / 4),
                                                      dtype=torch.int32))
        scale_shape = (output_size, input_size // self.ckpt_group) if self.ckpt_group \
            else (output_size,)
        _register(layer, "weight_scale", torch.empty(scale_shape, dtype=torch.float32))
        _register(layer, "weight_shape", torch.tensor([output_size, input_size]))

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard) -> None:
        """``weight_shape`` is checked, not placed; a channel scale [N, 1] lands as [N].

        Raises:
            ValueError: as :meth:`PackedInt4Method.load`.
        """
        _load_packed(layer, param, loaded, *shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """int8 ``q = u - 128`` from the stored bytes."""
        k = int(layer.weight_shape[1])
        q = (unpack_int32(layer.weight_packed.data, 8, k) - 128).to(torch.int8)
        _replace(layer, ("weight", "weight_scale"), ("weight_packed", "weight_shape"))
        _register(layer, "weight", q)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight_scale.dim() == 1:
            return super().apply_native(layer, x, bias)
        scale = layer.weight_scale.repeat_interleave(self.ckpt_group, dim=1)
        y = F.linear(x, (layer.weight.float() * scale).to(x.dtype))
        return y if bias is None else y + bias.to(x.dtype)

    def apply_cpu(self, layer: nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """Per channel: :class:`Int8WeightOnlyMethod`'s. Groups: kvflow's native INT8 kernel
        with the [N, K / G] scales applied per group inside it (one call, one rounding), or,
        under ``KVFLOW_CPU_QUANT=torch`` or without the native kernels, the dequantizing
        reference (torch's int8pack kernel takes one scale per row only)."""
        if layer.weight_scale.dim() == 1:
            return super().apply_cpu(layer, x, bias)
        kernels = native_int8_kernels(x)
        if kernels is None:
            return self.apply_native(layer, x, bias)
        return int8_gemm(kernels, x, layer.weight, layer.weight_scale,
                         None if bias is None else bias.float())
