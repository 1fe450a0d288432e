"""SiLU-and-mul, the gated activation of SwiGLU MLPs (Shazeer, "GLU Variants Improve
Transformer", 2020): ``out = silu(x[:, :I]) * x[:, I:]``.

SiLU is evaluated in fp32 and rounded to the input dtype before the multiply, the same
rounding points as HF's ``act_fn(gate_proj(x)) * up_proj(x)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(I, BLOCK)); each program handles BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation.

    Args:
        x: [..., 2*I] fp16/bf16/fp32 (gate half first, then up half); unit-stride last dim
            and rows viewable as [N, 2*I].
        out: optional preallocated [..., I] output (contiguous rows).

    Returns:
        [..., I] in ``x.dtype``.

    Raises:
        ValueError: if the last dim is odd or the layout is not row-viewable.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    inter = x.shape[-1] // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    try:
        x2 = x.view(-1, 2 * inter)
        out2 = out.view(-1, inter)
    except RuntimeError as exc:
        raise ValueError("x/out must be viewable as rows") from exc
    if out2.shape[0] != x2.shape[0] or out2.stride(-1) != 1:
        raise ValueError(f"out must be [..., {inter}] matching x's leading dims")
    if x2.shape[0] == 0:
        return out
    grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
    _silu_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=_BLOCK, num_warps=4
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference for :func:`silu_and_mul`."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    act = torch.nn.functional.silu(gate.float()).to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)
