"""RMSNorm and fused residual-add + RMSNorm (Zhang & Sennrich, "Root Mean Square Layer
Normalization", 2019), numerically matching Hugging Face ``LlamaRMSNorm``:

    y = weight * (x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps)).to(x.dtype)

The statistics are computed in fp32; the normalised value is rounded to the input dtype before
the weight multiply (exactly as HF does), so bf16 results match HF bit-for-bit in most rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row; with HAS_RESIDUAL, ``x + residual`` is formed (rounded to the
    input dtype, like the torch add it replaces), stored to ``res_out`` and normalised."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """View ``t`` [..., H] as [N, H] without copying (raises if impossible)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last dim")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"{name} cannot be viewed as [N, {t.shape[-1]}] rows") from exc


def _launch(x, residual, weight, out, res_out, eps: float) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    x2 = _as_rows(x, "x")
    out2 = _as_rows(out, "out")
    r2 = _as_rows(residual, "residual") if residual is not None else x2
    ro2 = _as_rows(res_out, "residual out") if res_out is not None else out2
    if out2.shape != x2.shape or ro2.shape != x2.shape:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)}, got {tuple(out.shape)}")
    if x2.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim.

    Args:
        x: [..., H] fp16/bf16/fp32 with unit-stride last dim and rows viewable as [N, H].
        weight: [H] (any float dtype; multiplied in fp32).
        eps: added to the mean square before the rsqrt.
        out: optional preallocated output shaped like ``x`` (may be ``x`` itself).

    Returns:
        [..., H] in ``x.dtype``.

    Raises:
        ValueError: on a bad ``weight`` shape, an ``out`` not shaped like ``x`` or a
            non-row-viewable layout.
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; ``normed = rms_norm(new_residual)`` in one pass.

    With ``inplace=True`` (default, vLLM's convention) ``residual`` is overwritten with
    ``new_residual`` and ``x`` with ``normed``, and the same two tensor objects are returned,
    i.e. ``(x, residual)``.  With ``inplace=False`` both results are fresh tensors and the
    inputs are untouched.  The sum is rounded to the input dtype before normalising (as the
    unfused ``residual + x`` in HF would be).

    Args:
        x, residual: [..., H], same shape and dtype, unit-stride last dim.
        weight: [H].
        eps: RMSNorm epsilon.

    Returns:
        (normed, new_residual), both [..., H] in ``x.dtype``.

    Raises:
        ValueError: when x and residual differ in shape or dtype, on a bad ``weight`` shape,
            or on a layout that cannot be viewed as unit-stride [N, H] rows.
    """
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError("x and residual must have the same shape and dtype")
    if inplace:
        out, res_out = x, residual
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, out, res_out, eps)
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference (HF ``LlamaRMSNorm`` ordering)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference for :func:`fused_add_rms_norm` (never in place)."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual
