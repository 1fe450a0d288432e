"""Quantized KV cache in plain torch: one scale per token and KV head (the reference the
attention backends and the Triton store kernel are tested against).

A cache of ``--kv-cache-dtype int8`` or ``fp8_e4m3`` holds each new key/value row ``x``
(``head_dim`` values of one token and KV head) as

* INT8: ``s = absmax(x) / 127``, ``q = clamp(round_half_even(x / s), -127, 127)``;
* FP8 e4m3: ``s = absmax(x) / 448``, ``q = fp8(x / s)`` (round to nearest even);

with ``s`` in float32 beside the block (``kv_scales [2, num_blocks, block_size, num_kv_heads]``,
0 = K, 1 = V, the same block ids as the cache), and reads ``x ~= q * s``. A per-token,
per-head scale follows each head's own range (keys of some heads are 10x larger than others'),
costs 4 bytes per ``head_dim`` values (6% at head_dim 64) and needs no calibration; the idea is
KIVI's per-token value quantization (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", 2024, arXiv:2402.02750) at 8 bits, symmetric. An all-zero row
gets a tiny scale and stays zero.

INT8 keys are rotated first. A key row's few outlier channels set its absmax, which leaves the
other channels a handful of levels each (gemma-3-270m: head_dim 256, 1 KV head; per-token
INT8 keys alone cost +1.2% perplexity). The attention layer therefore multiplies every query
and key row by an orthonormal Hadamard matrix ``R`` (:func:`key_rotation`) before the cache
sees them: ``(q R) . (k R) = q . k``, so scores are unchanged, while ``k R`` spreads each
outlier evenly over all channels and its absmax scale fits the row. This is QuaRot's
rotation of the KV cache (Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated
LLMs", 2024, arXiv:2404.00456), applied online to queries and keys only; values are stored
unrotated (their per-token INT8 error did not move gemma's perplexity) and FP8 e4m3, whose
exponent already keeps small channels' relative precision, is not rotated. Measured on
gemma-3-270m, fake-quantized keys and values, whole shipped text: per-token INT8 x1.0179,
per-token scales on groups of 64 / 32 channels x1.0142 / x1.0069, keys and values
Hadamard-rotated x1.0012 (the engine's own figure, keys only, is in docs/benchmarks.md).
"""

from __future__ import annotations

import torch

_EPS = torch.finfo(torch.float32).tiny

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows along the last dim.

    Args:
        x: [..., head_dim] float.
        cache_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        (q [..., head_dim] in ``cache_dtype``, scale float32 [...]).

    Raises:
        ValueError: for another ``cache_dtype``.
    """
    if cache_dtype not in QMAX:
        raise ValueError(f"KV cache dtype {cache_dtype} is not a quantized type")
    qmax = QMAX[cache_dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).clamp_(min=_EPS)
    y = xf / scale.unsqueeze(-1)
    if cache_dtype == torch.int8:
        return torch.round(y).clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(cache_dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., head_dim] * scale [...]`` in ``dtype`` (computed in float32)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def fake_quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the quantized cache gives it back (quantize then dequantize), in ``x.dtype``."""
    q, scale = quantize_kv(x, cache_dtype)
    return dequantize_kv(q, scale, x.dtype)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of 2), float32:
    entries ``+-1/sqrt(n)``, ``H @ H.T = I``, built as ``[[H, H], [H, -H]]``.

    Raises:
        ValueError: when ``n`` is not a positive power of 2.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-2 order, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / n ** 0.5


def key_rotation(head_dim: int) -> torch.Tensor:
    """The orthonormal rotation applied to queries and keys over an INT8 cache, float32
    [head_dim, head_dim]: block-diagonal Hadamard matrices of the largest power-of-2 order
    that divides ``head_dim`` (the whole head for 64, 128, 256; blocks of 16 for 80)."""
    block = head_dim & -head_dim  # the largest power of 2 dividing head_dim
    return torch.block_diag(*[hadamard_matrix(block)] * (head_dim // block))


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim] @ rotation`` computed in float32, returned contiguous in
    ``x.dtype``."""
    return torch.matmul(x.float(), rotation).to(x.dtype)
