"""Write new keys/values into the paged KV cache (``reshape_and_cache`` in vLLM terms).

Cache layout (see ``kvflow.attention.backend``)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

Token ``t`` goes to slot ``slot_mapping[t] = block_id * block_size + offset``; slot ``-1`` marks a
padding token that is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.kv_quant import QMAX, quantize_kv


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] K and V rows to its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    src_k = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]

    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rint(x):
    """Round half to even in fp32 for |x| < 2**22 (the 1.5 * 2**23 magic-number trick; exact
    IEEE adds, so the interpreter and GPUs agree with ``torch.round``)."""
    magic = 12582912.0
    return (x + magic) - magic


@triton.jit
def _round_to_e4m3(y):
    """``y`` (|y| <= 448) rounded to the nearest float8 e4m3 value, half to even, still in
    fp32: the spacing is 2**(e - 3) in binade e (subnormals: 2**-9). Done by hand because the
    Triton interpreter's own fp32 -> fp8 cast does not carry a rounded-up mantissa into the
    exponent; converting the already representable result is exact everywhere."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return _rint(tl.math.div_rn(y, ulp)) * ulp


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 (padding 0) -> (values rounded to the cache grid, fp32;
    scale [BLOCK_H] = absmax / QMAX) per row, the rule of ``kvflow.kernels.kv_quant``.

    Divisions are ``div_rn`` (IEEE round to nearest, as torch divides): Triton's ``/`` on
    fp32 compiles to the approximate ``div.full.f32`` on NVIDIA GPUs (up to 2 ulp off), which
    would move scales by an ulp and values across rounding ties, away from the torch store."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX), 1.1754943508222875e-38)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_FP8:
        y = _round_to_e4m3(y)
    else:
        y = _rint(y)
    return y, scale


@triton.jit
def _store_kvcache_quant_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    """One program per token: quantize its K and V rows per KV head, store values and
    scales at its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_KV_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    src_k = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    dst_scale = block * stride_sb + offset * stride_ss + offs_h
    k, k_scale = _quantize_rows(tl.load(src_k, mask=mask, other=0.0).to(tl.float32), QMAX,
                                IS_FP8)
    v, v_scale = _quantize_rows(tl.load(src_v, mask=mask, other=0.0).to(tl.float32), QMAX,
                                IS_FP8)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_scale_ptr + dst_scale, k_scale, mask=h_mask)
    tl.store(v_scale_ptr + dst_scale, v_scale, mask=h_mask)


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, H, D], got {kv_cache.shape}"
        )
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, H, D], got {k.shape} and {v.shape}")
    if tuple(k.shape[1:]) != tuple(kv_cache.shape[3:]):
        raise ValueError(f"k heads/dim {tuple(k.shape[1:])} != cache {tuple(kv_cache.shape[3:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(
            f"slot_mapping must be 1-D with at most {k.shape[0]} entries, got {slot_mapping.shape}"
        )


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter ``k``/``v`` into ``kv_cache`` at ``slot_mapping`` (in place, one kernel launch);
    with ``kv_scales`` the cache is quantized (int8 / float8_e4m3fn, one float32 scale per token
    and KV head, :mod:`kvflow.kernels.kv_quant`'s rule).

    Args:
        k, v: [T, num_kv_heads, head_dim], any float dtype (cast to the cache dtype); the last
            dim must be unit-stride (a strided token/head layout, e.g. a view of a fused QKV
            output, is fine).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; last dim unit-stride.
        slot_mapping: int32/int64 [N] with N <= T; token ``t < N`` goes to slot
            ``slot_mapping[t]``; ``-1`` skips the token; tokens ``t >= N`` are ignored.
        kv_scales: float32 [2, num_blocks, block_size, num_kv_heads] for a quantized cache.

    Raises:
        ValueError: on shape mismatches.
    """
    _check_inputs(k, v, kv_cache, slot_mapping)
    if kv_scales is not None:
        _store_quantized(k, v, kv_cache, slot_mapping, kv_scales)
        return
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must have a unit-stride last dim")
    _launch_store(k, v, kv_cache, slot_mapping)


def _launch_store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """The unquantized store launch, one program per slot_mapping entry (inputs checked and
    made unit-stride by :func:`store_kvcache`)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kvcache_kernel[(slot_mapping.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, KV_BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _store_quantized(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, kv_scales: torch.Tensor) -> None:
    """The quantized store launch (inputs checked by :func:`store_kvcache`)."""
    if kv_scales.shape != kv_cache.shape[:4] or kv_scales.dtype != torch.float32:
        raise ValueError(f"kv_scales must be float32 {tuple(kv_cache.shape[:4])}, got "
                         f"{kv_scales.dtype} {tuple(kv_scales.shape)}")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kvcache_quant_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, kv_scales[0], kv_scales[1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kv_scales.stride(1), kv_scales.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, KV_BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QMAX=QMAX[kv_cache.dtype], IS_FP8=kv_cache.dtype == torch.float8_e4m3fn,
    )


def store_kvcache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Plain-torch reference for :func:`store_kvcache` (same arguments, in place)."""
    _check_inputs(k, v, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for i, x in enumerate((k[t], v[t])):
            if kv_scales is None:
                kv_cache[i, block, offset] = x.to(kv_cache.dtype)
            else:
                kv_cache[i, block, offset], kv_scales[i, block, offset] = \
                    quantize_kv(x, kv_cache.dtype)
