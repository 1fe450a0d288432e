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
