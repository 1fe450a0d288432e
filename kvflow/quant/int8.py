"""Weight-only INT8 (W8A16): per-output-channel symmetric scales, activations unquantized.

``W[n, :] ~= weight_scale[n] * q[n, :]`` with ``q = round(W / s)`` in [-127, 127] and
``s = max_k |W[n, k]| / 127`` (absmax, per output channel), so ``x @ W.T = (x @ q.T) * s``:
the scale comes out of the dot product, and the product runs on int8 weights read from memory
(4x fewer bytes than fp32, 2x fewer than bf16: decode is memory-bound, so it runs faster).

Quantized on load from a float checkpoint (``--quantization int8``), or loaded pre-quantized
(compressed-tensors int8 checkpoints, :mod:`kvflow.quant.compressed_tensors`). CPU: kvflow's
native kernel (:func:`kvflow.kernels.cpu_quant.int8_gemm`: int8 read as int8 and widened in
registers, fp32 accumulation; any activation dtype and row count), or torch's
``_weight_int8pack_mm`` with ``KVFLOW_CPU_QUANT=torch`` or where the native kernels do not
build. torch's kernel did not turn the halved weight bytes into time (batch-1 decode of
SmolLM2 ran 1.73x slower than bf16, docs/benchmarks.md); the native one reads the weight at
up to the bf16 GEMM's bandwidth. Elsewhere the reference (int8 -> activation dtype, GEMM,
then the scales).

A W8A8 checkpoint (compressed-tensors ``int-quantized`` with dynamic per-token INT8 input
activations) also quantizes each activation row: ``sx = absmax / 127.5`` (compressed-tensors'
symmetric range ``(127 - (-128)) / 2``), ``qx = clamp(round(x / sx), -128, 127)``; the product
then runs on ``qx * sx`` -- the values transformers computes for such a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.config import cpu_quant_choice
from kvflow.kernels.cpu_native import NativeCpuKernels, native_cpu_kernels
from kvflow.kernels.cpu_quant import int8_gemm
from kvflow.quant.base import EmbeddingMethod, LinearMethod, check_stored_dtype
from kvflow.quant.shard_absmax import note_absmax, splits_columns, take_absmax

_CPU_16BIT = (torch.bfloat16, torch.float16)
_LOGITS_INT8PACK_ROWS = 2  # fp32 rows up to which the INT8 LM head runs torch's int8pack kernel


def _int8pack_takes(x: torch.Tensor) -> bool:
    """Whether torch's CPU ``_weight_int8pack_mm`` should take activations ``x``: CPU bf16 or
    fp16 with ``K % 16 == 0`` (its vectorized path crashes on other K in torch 2.13). Not fp32:
    torch 2.13's fp32 kernel is scalar (measured on a 1536 x 576 weight, one thread: 0.77 ms
    at 1 row, 432 ms at 512 rows, against 0.97 / 11.6 ms for widening the int8 weight and
    running the fp32 GEMM), so fp32 activations take the reference (widen, GEMM, scale)."""
    return x.device.type == "cpu" and x.dtype in _CPU_16BIT and x.shape[-1] % 16 == 0


def quantize_int8_per_channel(weight: torch.Tensor, row_absmax: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8 per output row.

    Args:
        weight: [N, K] float.
        row_absmax: float32 [N], each row's absmax over more columns than ``weight`` holds
            (a tensor-parallel shard's full checkpoint rows), or None: ``weight``'s own.

    Returns:
        (q int8 [N, K] in [-127, 127], scale float32 [N]) with ``weight ~= q * scale[:, None]``
        (an all-zero row gets scale 1).
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    if row_absmax is not None:
        absmax = torch.maximum(absmax, row_absmax.float())
    scale = absmax / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def native_int8_kernels(x: torch.Tensor) -> NativeCpuKernels | None:
    """kvflow's native kernels for an INT8 product on ``x``: CPU float activations, the choice
    ``native`` (:func:`kvflow.config.cpu_quant_choice`) and the kernels built; else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, *_CPU_16BIT) \
            or cpu_quant_choice() != "native":
        return None
    return native_cpu_kernels()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ (q * scale[:, None]).T (+ bias)`` in ``x.dtype``: kvflow's native
    kernel on CPU (:func:`native_int8_kernels`; one rounding, after the bias), else torch's
    CPU ``_weight_int8pack_mm`` where it takes ``x`` (16-bit activations), else the
    dequantized weight ``q * scale`` in ``x.dtype`` and a GEMM.

    Args:
        x: [..., K] activations.
        q: int8 [N, K]; scale: float32 [N]; bias: [N] or None.
    """
    kernels = native_int8_kernels(x)
    if kernels is not None:
        return int8_gemm(kernels, x, q, scale, None if bias is None else bias.float())
    y = _int8_linear_torch(x, q, scale)
    return y if bias is None else y + bias.to(x.dtype)


def _int8_linear_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if not _int8pack_takes(x):  # dequantized weight first, as transformers computes it
        return F.linear(x, (q.float() * scale[:, None]).to(x.dtype))
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch._weight_int8pack_mm(rows, q, scale.to(x.dtype))
    return y.view(*x.shape[:-1], y.shape[-1])


def fake_quantize_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to INT8 per row (last dim) and scaled back, in ``x.dtype``:
    ``clamp(round(x / s), -128, 127) * s`` with ``s = absmax / 127.5`` (compressed-tensors'
    dynamic per-token rule; an all-zero row stays zero)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32)
                                                                 .eps)
    return (torch.round(xf / scale).clamp_(-128, 127) * scale).to(x.dtype)


class Int8WeightOnlyMethod(LinearMethod):
    """``weight``: int8 [N, K]; ``weight_scale``: float32 [N].

    Args:
        prequantized: the checkpoint holds int8 weights and their scales (else a float weight
            is loaded and quantized in :meth:`process_weights_after_loading`).
        quantize_input: quantize activations per token to INT8 (W8A8 checkpoints).
    """

    name = "int8"

    def __init__(self, prequantized: bool = False, quantize_input: bool = False) -> None:
        super().__init__()
        self.prequantized, self.quantize_input = prequantized, quantize_input

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        dtype = torch.int8 if self.prequantized else params_dtype
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                    requires_grad=False)
        if self.prequantized:
            layer.weight_scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32),
                                              requires_grad=False)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard) -> None:
        """A checkpoint's per-channel scale [N, 1] lands as [N] in its rows; a float weight
        that a row-parallel rank slices by column has its full rows' absmax noted (the
        scale one process takes, :mod:`kvflow.quant.shard_absmax`).

        Raises:
            ValueError: for a pre-quantized weight not stored as int8.
        """
        if param is layer.weight and self.prequantized:
            check_stored_dtype(param, loaded)
        if param is getattr(layer, "weight_scale", None) and loaded.dim() == 2:
            loaded = loaded.reshape(-1)
        if param is layer.weight and not self.prequantized \
                and splits_columns(layer, param, loaded):
            note_absmax(layer, "rows", loaded.float().abs().amax(dim=1))
        layer.weight_loader(param, loaded, *shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.prequantized:
            return
        q, scale = quantize_int8_per_channel(layer.weight.data, take_absmax(layer, "rows"))
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """W8A16 as is; W8A8 runs the same GEMM on the per-token quantized activations."""
        if self.quantize_input:
            x = fake_quantize_int8_per_token(x)
        return super().apply(layer, x, bias)

    def apply_native(self, layer: nn.Module, x: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype))
        return y if bias is None else y + bias.to(x.dtype)

    def apply_cpu(self, layer: nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:  # a 16-bit bias's fp32 copy (worker/cpu_setup.py), if kept
            bias = layer.__dict__.get("bias_fp32", bias)
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


class Int8EmbeddingMethod(EmbeddingMethod):
    """A vocabulary table in INT8 with one scale per token row (the same absmax rule): the
    lookup dequantizes only the rows it gathers; the LM head multiplies the int8 table
    in fp32 (kvflow's native kernel on CPU, else ``_weight_int8pack_mm``). Used for the tables under ``int8`` and ``int4``
    (the LM head is the largest GEMM of a small model; 4 bits there cost more accuracy than
    they save, which is why llama.cpp's Q4 mixes keep ``output`` at 6-8 bits)."""

    name = "int8"

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim,
                                                dtype=params_dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_int8_per_channel(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer._quant_param_names = ("weight", "weight_scale")

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized: ``(q[ids].float() * scale[ids, None]).to(dtype)``; on CPU
        one C call with the native kernels (``layer.native_kernels``, set by
        ``worker/cpu_setup.py``; bit for bit the torch expression), so a CPU step graph can
        record it, else torch."""
        kernels = getattr(layer, "native_kernels", None)
        if kernels is not None:
            return kernels.int8_embedding(layer.weight, layer.weight_scale, ids,
                                          layer.params_dtype)
        rows = F.embedding(ids, layer.weight).float() * layer.weight_scale[ids, None]
        return rows.to(layer.params_dtype)

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V]: kvflow's native kernel on CPU (:func:`native_int8_kernels`;
        16-bit hidden states are widened inside it, the logits never rounded); otherwise
        torch's ``_weight_int8pack_mm`` on fp32 rows at decode (up to
        ``_LOGITS_INT8PACK_ROWS`` rows), else the widened table and the fp32 GEMM. Measured on
        SmolLM2's 49152 x 576 table, one thread, CPU ms: 1 row 25 vs 72 widened, 4 rows 96
        vs 98, 16 rows 393 vs 95 (torch's fp32 kernel is scalar; its 16-bit one would round
        the logits); the native kernel 3.7 ms at 1 row (docs/benchmarks.md)."""
        kernels = native_int8_kernels(hidden)
        if kernels is not None:
            return int8_gemm(kernels, hidden, layer.weight, layer.weight_scale,
                             out_dtype=torch.float32)
        x = hidden.float()
        rows = x.numel() // max(1, x.shape[-1])
        if x.device.type == "cpu" and x.shape[-1] % 16 == 0 and rows <= _LOGITS_INT8PACK_ROWS:
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), layer.weight,
                                          layer.weight_scale)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, layer.weight.float()) * layer.weight_scale
