"""Rotary embedding of q and k fused with the paged KV-cache store, in one launch.

The unfused CUDA path runs two kernels per attention layer: :func:`kvflow.kernels.rotary.
rotary_embedding` (q and k rotated in place) and :func:`kvflow.kernels.kv_store.store_kvcache`
(k and v scattered into the cache through ``slot_mapping``). Here one program per token rotates
its q heads in place, rotates its k heads in registers (writing them back in place too, so the
outputs equal the composition's), and stores the rotated k and the untouched v at the token's
slot, quantized (int8 / float8_e4m3fn, one scale per token and KV head) when the cache is.
At batch 1 this saves one launch per layer (32 per Llama-3.1-8B decode step); the idea is
vLLM's and SGLang's "fused rope + set KV buffer" kernels.

Rounding matches the composition exactly: rotation in fp32, rounded to k's dtype (as the
in-place rotary kernel stores it), then cast (or quantized) to the cache dtype.
Rotary layouts, partial rotary and the cos/sin table are as in :mod:`kvflow.kernels.rotary`;
the cache layout and slot rules as in :mod:`kvflow.kernels.kv_store`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.kv_quant import QMAX
from kvflow.kernels.kv_store import (
    _check_inputs,
    _quantize_rows,
    _rint,
    _round_to_e4m3,
    store_kvcache_ref,
)
from kvflow.kernels.rotary import (
    _as_heads,
    _load_cos_sin,
    _rotate_heads,
    rotary_embedding_ref,
)


@triton.jit
def _to_grid(x, scale, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """x [BLOCK_H, N] fp32 divided by its row's ``scale`` [BLOCK_H], clamped to +-QMAX and
    rounded to the cache grid (the rule of ``kv_store._quantize_rows``, with the scale given;
    IEEE division, ``div_rn``, as there)."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -QMAX), QMAX)
    if IS_FP8:
        return _round_to_e4m3(y)
    return _rint(y)


@triton.jit
def _pair_offsets(offs_r, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The offsets [1, BLOCK_R] within a head of each rotated pair's two elements (a, b):
    the two halves (neox) or interleaved neighbours (gpt-j)."""
    if IS_NEOX:
        a_off, b_off = offs_r[None, :], ROT_HALF + offs_r[None, :]
    else:
        a_off, b_off = 2 * offs_r[None, :], 2 * offs_r[None, :] + 1
    return a_off, b_off


@triton.jit
def _rotate_k(k_ptr, k_row, a_off, b_off, pair_mask, cos, sin):
    """The rotated pairs (a, b) [BLOCK_HK, BLOCK_R] of the k heads at ``k_row``: rotated in
    fp32, rounded to k's dtype, written back in place and returned."""
    a = tl.load(k_row + a_off, mask=pair_mask, other=0.0).to(tl.float32)
    b = tl.load(k_row + b_off, mask=pair_mask, other=0.0).to(tl.float32)
    new_a = (a * cos[None, :] - b * sin[None, :]).to(k_ptr.dtype.element_ty)
    new_b = (b * cos[None, :] + a * sin[None, :]).to(k_ptr.dtype.element_ty)
    tl.store(k_row + a_off, new_a, mask=pair_mask)
    tl.store(k_row + b_off, new_b, mask=pair_mask)
    return new_a, new_b


@triton.jit
def _load_rest(k_ptr, k_row, offs_rest, rest_mask, HAS_REST: tl.constexpr,
               BLOCK_HK: tl.constexpr, BLOCK_REST: tl.constexpr):
    """The k elements past the rotated ones [BLOCK_HK, BLOCK_REST] (partial rotary), else
    zeros."""
    if HAS_REST:
        rest = tl.load(k_row + offs_rest[None, :], mask=rest_mask, other=0.0)
    else:
        rest = tl.zeros([BLOCK_HK, BLOCK_REST], dtype=k_ptr.dtype.element_ty)
    return rest


@triton.jit
def _quantize_k_v(new_a, new_b, rest, v, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """k (its pairs and rest) and v on the cache grid, fp32, with one scale [BLOCK_HK] per
    head each (k's over all of its elements): ``(a, b, rest, v, k_scale, v_scale)``."""
    af, bf, restf = new_a.to(tl.float32), new_b.to(tl.float32), rest.to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(af), axis=1), tl.max(tl.abs(bf), axis=1))
    absmax = tl.maximum(absmax, tl.max(tl.abs(restf), axis=1))
    k_scale = tl.maximum(tl.math.div_rn(absmax, QMAX), 1.1754943508222875e-38)
    st_a, st_b = _to_grid(af, k_scale, QMAX, IS_FP8), _to_grid(bf, k_scale, QMAX, IS_FP8)
    st_rest = _to_grid(restf, k_scale, QMAX, IS_FP8)
    st_v, v_scale = _quantize_rows(v.to(tl.float32), QMAX, IS_FP8)
    return st_a, st_b, st_rest, st_v, k_scale, v_scale


@triton.jit
def _store_k_v(k_cache_ptr, v_cache_ptr, head, a_off, b_off, offs_rest, offs_d, st_a, st_b,
               st_rest, st_v, pair_mask, rest_mask, v_mask, keep, HAS_REST: tl.constexpr):
    """Store k (pairs, then rest) and v at the slot whose head offsets are ``head``
    [BLOCK_HK, 1], cast to the cache dtype; nothing when not ``keep``."""
    out_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + head + a_off, st_a.to(out_ty), mask=pair_mask & keep)
    tl.store(k_cache_ptr + head + b_off, st_b.to(out_ty), mask=pair_mask & keep)
    if HAS_REST:
        tl.store(k_cache_ptr + head + offs_rest[None, :], st_rest.to(out_ty),
                 mask=rest_mask & keep)
    tl.store(v_cache_ptr + head + offs_d[None, :], st_v.to(out_ty), mask=v_mask & keep)


@triton.jit(do_not_specialize=["num_slots"])  # the step's slot count (a mask bound)
def _rotary_kv_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
    v_scale_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
    num_q_heads, num_slots,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_REST: tl.constexpr, QUANT_KV: tl.constexpr,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr,
):
    """One program per token: rotate q in place; rotate k (in place) and store k, v."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROT_HALF
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cos, offs_r, r_mask, ROT_HALF)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, ROT_HALF, IS_NEOX,
                  BLOCK_HQ, BLOCK_R)

    # k: the rotated pairs (a, b) in registers, rounded to k's dtype, written back in place
    offs_h = tl.arange(0, BLOCK_HK)
    h_mask = offs_h < NUM_KV_HEADS
    pair_mask = h_mask[:, None] & r_mask[None, :]
    k_row = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh
    a_off, b_off = _pair_offsets(offs_r, ROT_HALF, IS_NEOX)
    new_a, new_b = _rotate_k(k_ptr, k_row, a_off, b_off, pair_mask, cos, sin)
    offs_rest = 2 * ROT_HALF + tl.arange(0, BLOCK_REST)
    rest_mask = h_mask[:, None] & (offs_rest[None, :] < HEAD_DIM)
    rest = _load_rest(k_ptr, k_row, offs_rest, rest_mask, HAS_REST, BLOCK_HK, BLOCK_REST)
    offs_d = tl.arange(0, BLOCK_D)
    v_mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=v_mask, other=0.0)

    # the store: tokens past slot_mapping's end or with slot -1 are skipped (masked)
    slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
    keep = slot >= 0
    safe = tl.maximum(slot, 0)
    head = (safe // KV_BLOCK_SIZE) * stride_cb + (safe % KV_BLOCK_SIZE) * stride_cs \
        + offs_h[:, None] * stride_ch
    if QUANT_KV:
        st_a, st_b, st_rest, st_v, k_scale, v_scale = _quantize_k_v(new_a, new_b, rest, v,
                                                                    QMAX, IS_FP8)
        dst_scale = safe // KV_BLOCK_SIZE * stride_sb + (safe % KV_BLOCK_SIZE) * stride_ss + offs_h
        tl.store(k_scale_ptr + dst_scale, k_scale, mask=h_mask & keep)
        tl.store(v_scale_ptr + dst_scale, v_scale, mask=h_mask & keep)
    else:
        st_a, st_b, st_rest, st_v = new_a, new_b, rest, v
    _store_k_v(k_cache_ptr, v_cache_ptr, head, a_off, b_off, offs_rest, offs_d, st_a, st_b,
               st_rest, st_v, pair_mask, rest_mask, v_mask, keep, HAS_REST)


def _check_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    if kv_scales is None:
        if kv_cache.dtype in QMAX:
            raise ValueError(f"a {kv_cache.dtype} KV cache needs kv_scales")
        return
    if kv_cache.dtype not in QMAX:
        raise ValueError(f"kv_scales given for a {kv_cache.dtype} (unquantized) KV cache")
    if kv_scales.shape != kv_cache.shape[:4] or kv_scales.dtype != torch.float32:
        raise ValueError(f"kv_scales must be float32 {tuple(kv_cache.shape[:4])}, got "
                         f"{kv_scales.dtype} {tuple(kv_scales.shape)}")


def rotary_store_kvcache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place and store the rotated ``k`` and ``v`` into the paged
    cache, in one launch: equal to ``rotary_embedding(positions, q, k, ...)`` followed by
    ``store_kvcache(k, v, kv_cache, slot_mapping, kv_scales)``.

    Args:
        positions: int64/int32 [T] absolute positions (``< cos_sin_cache.shape[0]``); one
            program per position, so q/k may hold padding rows beyond T (left untouched).
        q: [>=T, Hq, D], k / v: [>=T, Hkv, D]; float, unit-stride last dim (views into a
            fused QKV output are fine).
        cos_sin_cache: [max_pos, rot_dim] (cos half, then sin half), ``rot_dim <= D``, even.
        is_neox: True = rotate-halves layout, False = gpt-j interleaved pairs.
        kv_cache: [2, num_blocks, block_size, Hkv, D], unit-stride last dim.
        slot_mapping: int32/int64 [N], N <= T; token ``t < N`` goes to slot
            ``slot_mapping[t]`` (-1 skips it); tokens ``t >= N`` are rotated, not stored.
        kv_scales: float32 [2, num_blocks, block_size, Hkv] for an int8 / float8_e4m3fn
            cache, else None.

    Returns:
        ``(q, k)``, the same tensors, rotated in place.

    Raises:
        ValueError: on inconsistent shapes, strides, dtypes or scales.
    """
    q3, k3 = _as_heads(q, None, "q"), _as_heads(k, q.shape[-1], "k")
    _check_inputs(k3, v, kv_cache, slot_mapping)
    _check_scales(kv_cache, kv_scales)
    rot_dim, head_dim, num_tokens = cos_sin_cache.shape[-1], q3.shape[-1], positions.shape[0]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if min(q3.shape[0], k3.shape[0]) < num_tokens or slot_mapping.shape[0] > num_tokens:
        raise ValueError("q/k have fewer tokens than positions, or slot_mapping has more")
    if v.stride(-1) != 1 or kv_cache.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("v, kv_cache and cos_sin_cache must have a unit-stride last dim")
    if num_tokens:
        _launch(positions, q3, k3, v, cos_sin_cache, is_neox, kv_cache, slot_mapping, kv_scales)
    return q, k


def _launch(positions, q3, k3, v, cos_sin_cache, is_neox, kv_cache, slot_mapping,
            kv_scales) -> None:
    """The kernel launch (inputs checked by :func:`rotary_store_kvcache`)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rot_half = cos_sin_cache.shape[-1] // 2
    scales = kv_scales if kv_scales is not None else cos_sin_cache.new_empty(2, 1, 1, 1)
    _rotary_kv_store_kernel[(positions.shape[0],)](
        positions, q3, k3, v, cos_sin_cache, k_cache, v_cache, scales[0], scales[1],
        slot_mapping,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scales.stride(1), scales.stride(2),
        q3.shape[1], slot_mapping.shape[0],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT_HALF=rot_half,
        KV_BLOCK_SIZE=block_size, IS_NEOX=is_neox,
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_REST=triton.next_power_of_2(max(head_dim - 2 * rot_half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_REST=2 * rot_half < head_dim,
        QUANT_KV=kv_scales is not None, QMAX=QMAX.get(kv_cache.dtype, 1.0),
        IS_FP8=kv_cache.dtype == torch.float8_e4m3fn, num_warps=4,
    )


def rotary_store_kvcache_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference for :func:`rotary_store_kvcache`: the rotary reference, then the
    store reference (``kv_cache`` / ``kv_scales`` updated in place). Returns fresh rotated
    ``(q, k)`` over the first T tokens; the inputs q and k are untouched."""
    head_dim = q.shape[-1]
    new_q, new_k = rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox, head_dim)
    store_kvcache_ref(new_k, v[:positions.shape[0]], kv_cache, slot_mapping, kv_scales)
    return new_q, new_k
