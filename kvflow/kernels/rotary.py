"""Rotary position embedding (Su et al., "RoFormer: Enhanced Transformer with Rotary Position
Embedding", 2021), applied in place to q and k.

``cos_sin_cache[pos] = [cos(pos * f_0) .. cos(pos * f_{R/2-1}), sin(pos * f_0) .. ]`` with
``R = rot_dim`` (the first ``rot_dim`` dims of each head are rotated; the rest pass through,
i.e. partial rotary is supported).  Pair ``i`` of a head is

* neox layout (``is_neox=True``, HF Llama/Qwen "rotate_half"): ``(x[i], x[i + R/2])``;
* gpt-j layout (``is_neox=False``, interleaved): ``(x[2i], x[2i + 1])``;

and is rotated as ``(a, b) -> (a cos - b sin, b cos + a sin)``.  Math is done in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    row,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h[:, None] < num_heads) & (offs_r[None, :] < ROT_HALF)
    base = x_ptr + row * stride_t + offs_h[:, None] * stride_h
    if IS_NEOX:
        a_ptr = base + offs_r[None, :]
        b_ptr = base + ROT_HALF + offs_r[None, :]
    else:
        a_ptr = base + 2 * offs_r[None, :]
        b_ptr = base + 2 * offs_r[None, :] + 1
    a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
    new_a = a * cos[None, :] - b * sin[None, :]
    new_b = b * cos[None, :] + a * sin[None, :]
    tl.store(a_ptr, new_a.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(b_ptr, new_b.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_cos_sin(cos_sin_ptr, pos, stride_cos, offs_r, r_mask, ROT_HALF: tl.constexpr):
    """Position ``pos``'s cos and sin halves [BLOCK_R] in fp32 (0 past ``ROT_HALF``)."""
    cos = tl.load(cos_sin_ptr + pos * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + ROT_HALF + offs_r, mask=r_mask,
                  other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads,
    ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program per token: rotate all its q heads (and k heads)."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROT_HALF
    cos, sin = _load_cos_sin(cache_ptr, pos, stride_cache, offs_r, r_mask, ROT_HALF)
    _rotate_heads(q_ptr, row, stride_qt, stride_qh, num_q_heads, cos, sin, ROT_HALF, IS_NEOX,
                  BLOCK_HQ, BLOCK_R)
    if HAS_K:
        _rotate_heads(k_ptr, row, stride_kt, stride_kh, num_k_heads, cos, sin, ROT_HALF,
                      IS_NEOX, BLOCK_HK, BLOCK_R)


def _as_heads(x: torch.Tensor, head_size: int | None, name: str) -> torch.Tensor:
    """View ``x`` ([T, H*D] or [T, H, D]) as [T, H, D] without copying."""
    if x.dim() == 3:
        if head_size is not None and x.shape[-1] != head_size:
            raise ValueError(f"{name}: head_size {head_size} != last dim {x.shape[-1]}")
        view = x
    elif x.dim() == 2:
        if head_size is None or x.shape[-1] % head_size != 0:
            raise ValueError(f"{name} is 2-D: pass a head_size dividing {x.shape[-1]}")
        view = x.view(x.shape[0], x.shape[-1] // head_size, head_size)
    else:
        raise ValueError(f"{name} must be [T, H*D] or [T, H, D], got {tuple(x.shape)}")
    if view.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last dim (it is updated in place)")
    return view


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    head_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply rotary embedding to ``q`` and ``k`` in place (one launch).

    Args:
        positions: int64 (or int32) [T], absolute token positions, ``< max_pos``.
        q: [T, Hq, D] or [T, Hq*D] (then ``head_size`` is required); any float dtype, unit
            last-dim stride; token/head strides are free (views into a fused QKV work).
        k: like ``q`` with Hkv heads, or ``None`` to rotate ``q`` only.
        cos_sin_cache: [max_pos, rot_dim], cos half then sin half; ``rot_dim <= D``, even.
        is_neox: True = rotate-halves layout, False = gpt-j interleaved layout.
        head_size: D; needed only for 2-D ``q``/``k``.

    Returns:
        ``(q, k)`` -- the same tensors, modified in place.

    Raises:
        ValueError: on inconsistent shapes or a non-unit last-dim stride.
    """
    q3 = _as_heads(q, head_size, "q")
    head_dim = q3.shape[-1]
    k3 = _as_heads(k, head_dim, "k") if k is not None else None
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    num_tokens = positions.shape[0]
    if q3.shape[0] < num_tokens or (k3 is not None and k3.shape[0] < num_tokens):
        raise ValueError("q/k have fewer tokens than positions")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if num_tokens == 0:
        return q, k
    _launch(positions, q3, k3, cos_sin_cache, is_neox)
    return q, k


def _launch(positions: torch.Tensor, q3: torch.Tensor, k3: torch.Tensor | None,
            cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """The kernel launch, one program per position (inputs checked by
    :func:`rotary_embedding`); without ``k3`` the kernel gets q3 as an unused k."""
    k_arg = k3 if k3 is not None else q3
    rot_dim = cos_sin_cache.shape[-1]
    _rotary_kernel[(positions.shape[0],)](
        positions, q3, k_arg, cos_sin_cache,
        q3.stride(0), q3.stride(1), k_arg.stride(0), k_arg.stride(1), cos_sin_cache.stride(0),
        q3.shape[1], k_arg.shape[1],
        ROT_HALF=rot_dim // 2, IS_NEOX=is_neox, HAS_K=k3 is not None,
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k_arg.shape[1]),
        BLOCK_R=triton.next_power_of_2(rot_dim // 2), num_warps=4,
    )


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    """x: [T, H, D]; cos/sin: [T, R/2] fp32.  Returns the rotated copy in x.dtype."""
    rot_dim = cos.shape[-1] * 2
    xf = x.float()
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    if is_neox:
        a, b = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    new_a, new_b = a * cos - b * sin, b * cos + a * sin
    if is_neox:
        rot = torch.cat([new_a, new_b], dim=-1)
    else:
        rot = torch.stack([new_a, new_b], dim=-1).flatten(-2)
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    head_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference for :func:`rotary_embedding`; returns new tensors (inputs untouched)."""
    head_size = head_size if q.dim() == 2 else q.shape[-1]
    rot_half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, :rot_half], cs[:, rot_half:]
    t = positions.shape[0]

    def apply(x: torch.Tensor) -> torch.Tensor:
        x3 = x[:t].reshape(t, -1, head_size)
        return _rotate_ref(x3, cos, sin, is_neox).reshape(x[:t].shape)

    return apply(q), (apply(k) if k is not None else None)
