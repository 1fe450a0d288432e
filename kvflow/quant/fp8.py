"""FP8 W8A8: float8 e4m3 weights with per-tensor scales, activations quantized to float8 per
token at run time (or with a checkpoint's static per-tensor input scale).

Scales (the OCP FP8 e4m3 format; Micikevicius et al., "FP8 Formats for Deep Learning", 2022,
arXiv:2209.05433): ``s = absmax / 448`` (448 is e4m3's largest finite value) and
``q = fp8(x / s)``, so ``x ~= q * s``. Weights get one scale per checkpoint tensor (``--quantization fp8``
quantizes a float checkpoint on load, one scale for each of q, k, v, gate and up even where the
layer fuses them) or, from a compressed-tensors checkpoint, what it stores: one per tensor or
one per output channel. Activations get one scale per token row (dynamic), computed per call. The
product is then

    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]

so both scales come out of the dot product: the per-tensor weight scales are expanded to one
per output row after loading (``weight_scale`` float32 [N]), which is what the row-wise
``torch._scaled_mm`` takes (``scale_a`` [M, 1], ``scale_b`` [1, N]).

Paths: CUDA runs ``torch._scaled_mm`` (FP8 tensor cores on Hopper: H100/H200); the CPU and
every other device run :meth:`Fp8LinearMethod.apply_native`, which dequantizes the FP8 weight
and the quantized activations to fp32 and multiplies (the same values transformers computes for
compressed-tensors FP8 models). torch's CPU ``_scaled_mm`` gives the same numbers but is
slower than that on the CPUs measured (tens of ms per decode GEMM), so it is not the CPU path;
tests run the CUDA path's function on CPU against the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.platforms.cuda import fp8_gemm_supported
from kvflow.quant.base import LinearMethod, check_stored_dtype
from kvflow.quant.shard_absmax import note_absmax, take_absmax

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_SCALE_EPS = torch.finfo(torch.float32).eps


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale))`` in e4m3 (round to nearest even), any broadcastable scale."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_tensor(w: torch.Tensor, absmax: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor like ``w``, float32 scalar scale) with ``scale = absmax / 448``; ``absmax``
    (float32 scalar) is the whole checkpoint tensor's when ``w`` is a tensor-parallel shard of
    it, else None: ``w``'s own."""
    own = w.float().abs().amax()
    absmax = own if absmax is None else torch.maximum(own, absmax.float())
    scale = (absmax / FP8_MAX).clamp(min=_SCALE_EPS)
    return quantize_fp8(w, scale), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization.

    Args:
        x: [M, K] float.

    Returns:
        (qx fp8 [M, K], scale float32 [M, 1]) with ``x ~= qx * scale``; an all-zero row gets
        a tiny scale (its values stay 0).
    """
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_SCALE_EPS)
    return quantize_fp8(x, scale), scale


def scaled_mm_rowwise(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``(qx @ qw.T) * sx * sw.T`` on ``torch._scaled_mm`` (FP8 tensor cores on CUDA).

    Args:
        qx: fp8 [M, K] activations; sx: float32 [M, 1].
        qw: fp8 [N, K] weight (row-major: passed transposed, i.e. column-major, as cuBLASLt
            wants); sw: float32 [N].
        out_dtype: result dtype. Row-wise scaling on CUDA produces bfloat16 only; other types
            are cast from it.

    Returns:
        [M, N] in ``out_dtype``.
    """
    mm_dtype = torch.bfloat16 if qx.device.type == "cuda" else out_dtype
    y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=mm_dtype)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 ``x [M, K] @ (qw * sw[:, None]).T`` in ``x.dtype``: the activations quantized
    per token (or with the static ``input_scale``), then ``torch._scaled_mm`` on CUDA where
    K and N are multiples of 16, else the dequantized product in fp32.

    Args:
        x: [M, K] float; qw: fp8 [N, K]; sw: float32 [N]; input_scale: float32 scalar or None.
    """
    if input_scale is None:
        qx, sx = quantize_fp8_per_token(x)
    else:
        sx = input_scale.float().expand(x.shape[0], 1)
        qx = quantize_fp8(x, sx)
    n, k = qw.shape
    if x.device.type == "cuda" and k % 16 == 0 and n % 16 == 0:
        return scaled_mm_rowwise(qx, sx, qw, sw, x.dtype)
    return (F.linear(qx.float() * sx, qw.float()) * sw).to(x.dtype)


class Fp8LinearMethod(LinearMethod):
    """After loading: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N] (one per
    output row), ``input_scale`` float32 scalar for static activation scales (else None:
    dynamic per token).

    Args:
        prequantized: the checkpoint holds FP8 weights and scales (compressed-tensors), else a
            float weight is loaded and quantized per tensor after loading.
        weight_strategy: for prequantized weights, ``"tensor"`` (one scale per checkpoint
            tensor, i.e. per fused shard) or ``"channel"`` (one per output row).
        static_input: the checkpoint carries a per-tensor ``input_scale`` (static
            activations); else activations are quantized per token at run time.
        quantize_input: False for FP8 weight-only checkpoints (W8A16): activations stay in the
            model dtype.
    """

    name = "fp8"

    def __init__(self, prequantized: bool = False, weight_strategy: str = "tensor",
                 static_input: bool = False, quantize_input: bool = True) -> None:
        super().__init__()
        self.prequantized, self.weight_strategy = prequantized, weight_strategy
        self.static_input = static_input and quantize_input
        self.quantize_input = quantize_input

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        dtype = FP8_DTYPE if self.prequantized else params_dtype
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                    requires_grad=False)
        if not self.prequantized:
            return
        shards = len(layer.shard_ids)
        # channel scales: one per output row, [N] (a checkpoint's [N, 1] loads into it: a
        # row-parallel rank keeps every row's scale rather than cutting it by column)
        scale_shape = (output_size,) if self.weight_strategy == "channel" else (shards,)
        layer.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32),
                                          requires_grad=False)
        if self.static_input:
            layer.input_scale = nn.Parameter(torch.ones(shards, dtype=torch.float32),
                                             requires_grad=False)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard) -> None:
        """Weights and per-channel scales go to their rows (the layer's loader; a checkpoint's
        per-channel scale [N, 1] lands as [N]); a per-tensor scale goes to its shard's slot.

        Raises:
            ValueError: for a per-tensor scale that is not one value, an unknown shard, or a
                pre-quantized weight not stored as float8_e4m3fn.
        """
        per_shard = param is getattr(layer, "input_scale", None) or (
            param is getattr(layer, "weight_scale", None) and self.weight_strategy == "tensor")
        if not per_shard:
            if param is layer.weight and self.prequantized:
                check_stored_dtype(param, loaded)
            if param is getattr(layer, "weight_scale", None) and loaded.dim() == 2:
                loaded = loaded.reshape(-1)
            if param is layer.weight and not self.prequantized and layer.tp_size > 1:
                # the whole checkpoint tensor's absmax: the scale one process takes
                note_absmax(layer, shard[0] if shard else None, loaded.float().abs().amax())
            layer.weight_loader(param, loaded.to(param.dtype), *shard)
            return
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor FP8 scale must be one value, got shape "
                             f"{tuple(loaded.shape)}")
        key = shard[0] if shard else None
        if key not in layer.shard_ids:
            raise ValueError(f"shard {key!r} is not one of {layer.shard_ids}")
        param.data[layer.shard_ids.index(key)] = loaded.reshape(()).float()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        n = layer.weight.shape[0]
        if not self.prequantized:  # one scale per checkpoint tensor (fused shard)
            parts = [quantize_fp8_per_tensor(w, take_absmax(layer, key)) for w, key in
                     zip(layer.weight.data.split(_shard_rows(layer, n)), layer.shard_ids)]
            layer.weight = nn.Parameter(torch.cat([q for q, _ in parts]), requires_grad=False)
            layer.weight_scale = nn.Parameter(
                torch.cat([s.expand(q.shape[0]) for q, s in parts]), requires_grad=False)
            layer.input_scale = None
            return
        if self.weight_strategy == "tensor":  # shard scalars -> one per row of each shard
            sizes = _shard_rows(layer, n)
            layer.weight_scale = nn.Parameter(
                torch.repeat_interleave(layer.weight_scale.data, torch.tensor(sizes)),
                requires_grad=False)
        if self.static_input:  # fused shards share one input: the largest scale covers all
            layer.input_scale = nn.Parameter(layer.input_scale.data.amax(), requires_grad=False)
        else:
            layer.input_scale = None

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """The dequantized reference (fp32 GEMM of the FP8 values and their scales)."""
        rows = x.reshape(-1, x.shape[-1])
        if self.quantize_input:
            y = fp8_linear(rows.float(), layer.weight, layer.weight_scale, layer.input_scale)
        else:
            y = F.linear(rows.float(), layer.weight.float()) * layer.weight_scale
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def apply_cuda(self, layer: nn.Module, x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """``torch._scaled_mm`` (row-wise scales) where the shape allows (K and N multiples of
        16) and the GPU has FP8 tensor cores (compute capability 8.9+; an A100's
        ``_scaled_mm`` raises); the reference otherwise and for weight-only FP8."""
        n, k = layer.weight.shape
        if not self.quantize_input or k % 16 or n % 16 or not fp8_gemm_supported(x.device):
            return self.apply_native(layer, x, bias)
        rows = x.reshape(-1, k)
        if layer.input_scale is None:
            qx, sx = quantize_fp8_per_token(rows)
        else:
            sx = layer.input_scale.float().expand(rows.shape[0], 1)
            qx = quantize_fp8(rows, sx)
        y = scaled_mm_rowwise(qx, sx, layer.weight, layer.weight_scale, x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.view(*x.shape[:-1], n)


def _shard_rows(layer: nn.Module, n: int) -> list[int]:
    """Output rows of each fused shard of ``layer`` (in ``layer.shard_ids`` order)."""
    if len(layer.shard_ids) == 1:
        return [n]
    if hasattr(layer, "output_sizes"):  # gate/up
        return [size // layer.tp_size for size in layer.output_sizes]
    q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    return [q, kv, kv]
