"""Weight-only INT8 GEMM on CPU, made for few activation rows (decode), from kvflow's native
kernels (``csrc/cpu_quant_gemm.c``): the int8 weight is read as int8 and widened in registers
(to fp32 for FMA, or, for bf16 activations on AVX512-BF16, to bf16 for VDPBF16PS), so a
batch-1 product reads half the bytes of a bf16 one.

Bound on the library :func:`kvflow.kernels.cpu_native.native_cpu_kernels` builds (one per ISA
level: AVX512-BF16, AVX512, AVX2, baseline). :func:`int8_gemm` equals ``(x @ q.T) * scale +
bias`` computed in float64 up to fp32 rounding: K exact products summed in fp32 (bound:
``K * 2**-24 * |x| @ |q|.T * scale``), then one rounding to the output dtype. With group
scales ``scale`` [N, K / G] (GPTQ 8-bit, compressed-tensors W8A16 groups) each group's partial
dot product is multiplied by its scale inside the kernel before the groups are added (bound:
``(K + 2) * 2**-24 * |x| @ (|q| * scale).T``, the scale repeated over its G columns).
"""

from __future__ import annotations

import math

import torch

from kvflow.kernels.cpu_native import NativeCpuKernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    n, k = q.shape if q.dim() == 2 else (-1, -1)
    if x.device.type != "cpu" or x.dtype not in _DTYPE_CODES or x.shape[-1] != k \
            or out_dtype not in _DTYPE_CODES:
        raise ValueError(f"int8_gemm: x must be a float32/bfloat16/float16 CPU [..., {k}] "
                         f"tensor and out_dtype one of those, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device} -> {out_dtype}")
    if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"int8_gemm: q must be an int8 CPU [N, K] tensor with unit-stride rows, "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None or name == "scale" and t.dim() == 2:
            continue
        if t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous() \
                or t.device.type != "cpu":
            raise ValueError(f"int8_gemm: {name} must be contiguous float32 [{n}] on CPU")
    if scale.dim() == 2 and (scale.dtype != torch.float32 or scale.shape[0] != n
                             or not scale.is_contiguous() or scale.device.type != "cpu"
                             or scale.shape[1] < 1 or k % scale.shape[1]):
        raise ValueError(f"int8_gemm: a group scale must be contiguous float32 [{n}, K / G] "
                         f"on CPU with K = {k} a multiple of its columns, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def int8_gemm(kernels: NativeCpuKernels, x: torch.Tensor, q: torch.Tensor,
              scale: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(x @ q.T) * scale + bias`` with the int8 weight widened in registers, fp32
    accumulation, one rounding to ``out_dtype``.

    Args:
        kernels: the native kernels (:func:`kvflow.kernels.cpu_native.native_cpu_kernels`).
        x: [..., K] float32/bfloat16/float16 CPU activations (a strided last dim is copied).
        q: int8 [N, K], unit-stride rows (symmetric weights).
        scale: float32 [N], the per-channel scales, or [N, K / G] contiguous, one per group
            of G consecutive input columns (``G = K // scale.shape[1]``); bias: float32 [N]
            or None.
        out_dtype: the result's dtype (default ``x.dtype``); float32 keeps the accumulation
            unrounded (logits).

    Returns:
        [..., N] in ``out_dtype``, a fresh tensor. Each element's summation order depends only
        on K, G, x's dtype and the path (bf16 ``x`` of 2+ rows on AVX512-BF16, with groups
        when G is a multiple of 32: bf16 dot products; otherwise fp32 FMA), not on the other
        rows or the thread count.

    Raises:
        ValueError: on a dtype, device, shape or layout mismatch.
        MemoryError: when the kernel cannot allocate the fp32 copy of 16-bit activations.
    """
    out_dtype = out_dtype or x.dtype
    _check_int8(x, q, scale, bias, out_dtype)
    n, k = q.shape
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype)
    # through the kernels object's entry points, which a CPU step-graph recorder wraps (a call
    # straight to the library escaped the recording: replays skipped every INT8 product)
    head = (rows.data_ptr(), rows.stride(0), _DTYPE_CODES[x.dtype], q.data_ptr(), q.stride(0),
            scale.data_ptr())
    tail = (None if bias is None else bias.data_ptr(), out.data_ptr(), n,
            _DTYPE_CODES[out_dtype], rows.shape[0], n, k, torch.get_num_threads())
    if scale.dim() == 2:
        status = kernels._int8_gemm_grouped(*head, k // scale.shape[1], *tail)
    else:
        status = kernels._int8_gemm(*head, *tail)
    if status:
        raise MemoryError("native int8_gemm could not allocate the fp32 copy of x")
    return out.view(*x.shape[:-1], n)

