"""Dequantization of llama.cpp GGML blocks in plain torch (vectorized over all blocks).

Each function takes the raw blocks of some rows, uint8 ``[R, row_bytes]`` exactly as stored in
a GGUF file, and returns float32 ``[R, row_bytes / block_bytes * block_elems]``. The layouts
and formulas are ggml's (``ggml-quants.c``, ``dequantize_row_*``; block structs in
``ggml-common.h``); ``gguf.quants.dequantize`` (numpy) is the oracle they are tested against.
They run on any device, so the same code dequantizes one tile of a GEMM on CPU and on CUDA.

=========  ======  =====  ==========================================================
type       elems   bytes  layout: value
=========  ======  =====  ==========================================================
Q4_0       32      18     d f16, qs[16]: (nibble - 8) * d
Q4_1       32      20     d f16, m f16, qs[16]: nibble * d + m
Q5_0       32      22     d f16, qh u32, qs[16]: (nibble | high bit << 4) - 16) * d
Q8_0       32      34     d f16, qs int8[32]: q * d
Q4_K       256     144    d, dmin f16, 12 bytes of 6-bit (scale, min) x 8, qs[128]:
                          d * sc * nibble - dmin * m per 32-element sub-block
Q5_K       256     176    as Q4_K plus qh[32]: one high bit per element
Q6_K       256     210    ql[128], qh[64], scales int8[16], d f16:
                          d * sc * (6-bit q - 32) per 16-element sub-block
=========  ======  =====  ==========================================================
Low nibbles come first: in a 32-element block, element ``j < 16`` is byte ``j``'s low nibble
and ``j + 16`` its high nibble (K types: per 64 elements, 32 low then 32 high).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# GGML type ids (gguf.GGMLQuantizationType)
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 8, 12, 13, 14, 30

BLOCK_SHAPES: dict[int, tuple[int, int]] = {  # type -> (elements, bytes) per block
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34),
    Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
TYPE_NAMES: dict[int, str] = {F32: "F32", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
                              Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2k] uint8 -> [..., k] float32 (little-endian fp16 pairs)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] (all low nibbles, then all high nibbles) as int32."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).int()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[..., 2:]) - 8).float() * _f16(b[..., :2])


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[..., 4:]).float() * _f16(b[..., :2]) + _f16(b[..., 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 2:6].contiguous().view(torch.int32)  # [..., 1], little-endian
    high = (qh >> torch.arange(32, device=b.device, dtype=torch.int32)) & 1
    return ((_nibbles(b[..., 6:]) | (high << 4)) - 16).float() * _f16(b[..., :2])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 (scale, min) 6-bit pairs packed in 12 bytes (ggml ``get_scale_min_k4``)."""
    s = s.int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.float(), m.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 128] -> [..., 8, 32]: sub-block 2c = low nibbles of bytes 32c..32c+31,
    sub-block 2c+1 their high nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32).int()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144]).float()
    w = (d * sc)[..., None] * q - (dmin * m)[..., None]
    return w.flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    qh = b[..., 16:48].int()[..., None, :]  # [..., 1, 32]
    high = (qh >> torch.arange(8, device=b.device, dtype=torch.int32)[:, None]) & 1
    q = (_k_nibbles(b[..., 48:176]) + (high << 4)).float()
    w = (d * sc)[..., None] * q - (dmin * m)[..., None]
    return w.flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32).int()  # [half, first/second 32, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32).int()
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.int32)[:, None]  # 0,2,4,6
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # groups 0..3: ql0 lo, ql1 lo, ql0 hi, ql1 hi
    q = (low | (((qh >> shifts) & 3) << 4)) - 32  # [..., 2, 4, 32]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # one per 16 elements
    d = _f16(b[..., 208:210])
    w = q.float().reshape(*b.shape[:-1], 16, 16) * (d * sc)[..., None]
    return w.flatten(-2)


_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}

SUPPORTED_TYPES = tuple(_DEQUANT)


def dequantize_rows(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 ``[R, K]`` from the raw blocks ``raw`` uint8 ``[R, row_bytes]`` of ``ggml_type``.

    Raises:
        ValueError: for a GGML type without a dequantizer here, or a row not made of whole
            blocks.
    """
    if ggml_type not in _DEQUANT:
        raise ValueError(f"GGML type {ggml_type} cannot be kept quantized (supported: "
                         f"{sorted(_DEQUANT)})")
    elems, nbytes = BLOCK_SHAPES[ggml_type]
    rows, row_bytes = raw.shape
    if row_bytes % nbytes:
        raise ValueError(f"a row of {row_bytes} bytes is not whole {nbytes}-byte blocks")
    blocks = raw.reshape(rows, row_bytes // nbytes, nbytes)
    return _DEQUANT[ggml_type](blocks).reshape(rows, row_bytes // nbytes * elems)


def row_elements(row_bytes: int, ggml_type: int) -> int:
    """Elements in a row of ``row_bytes`` bytes of ``ggml_type``."""
    elems, nbytes = BLOCK_SHAPES[ggml_type]
    return row_bytes // nbytes * elems
