"""Segmented multi-LoRA matmul (SGMV): each adapted token row times its own adapter's A, then B.

A step's adapted tokens are listed grouped by adapter slot (``token_index``, sorted by slot)
and cut into segments ``(slot, start, end)``: ``token_index[start:end]`` all run ``slot``. Two
launches cover every adapter of the step, as in Punica's SGMV (Chen et al. 2023, "Punica:
Multi-Tenant LoRA Serving", arXiv:2310.18547) and S-LoRA's batched LoRA kernels (Sheng et al.
2023, "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", arXiv:2311.03285):

* shrink: ``s[i] = x[token_index[i]] A[slot]^T`` (``[N, R]``, rounded to ``x.dtype`` as the
  torch path rounds its intermediate), one program per (segment, row tile, rank tile);
* expand: ``y[token_index[i]] += s[i] B[slot]^T``, one program per (segment, row tile, output
  tile), accumulated in fp32 and added in place. A token appears once in ``token_index``, so no
  two programs write the same output row and no atomics are needed.

Input rows are gathered by index (the grouped copy is never made). A fused layer (q/k/v,
gate/up) is one matmul pair: its ``B`` is block-diagonal over the shards' rank columns (see
``kvflow/lora/layers.py``). The grid is sized from the longest segment on the host, so the op
is not CUDA-graph capturable (LoRA steps run eager). The torch reference is
:func:`kvflow.lora.layers.grouped_lora`. Tested in the Triton interpreter on CPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M, _BLOCK_R, _BLOCK_K, _BLOCK_N = 16, 16, 64, 64


@triton.jit
def _segment_rows(seg_ptr, tok_ptr, BLOCK_M: tl.constexpr):
    """This program's (adapter slot, rows of its segment's row tile, which of them lie in the
    segment, their token indices): segment ``program_id(0)``'s (slot, start, end) triple,
    row tile ``program_id(1)``."""
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + seg * 3).to(tl.int64)
    end = tl.load(seg_ptr + seg * 3 + 2)
    rows = tl.load(seg_ptr + seg * 3 + 1) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return slot, rows, row_ok, tok


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, s_ptr, tok_ptr, seg_ptr, in_dim, rank,
                        stride_x, stride_a_slot, stride_a_r, stride_s,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Grid (segments, row tiles, rank tiles): s[rows, r] = x[tok[rows]] @ A[slot, r]^T."""
    slot, rows, row_ok, tok = _segment_rows(seg_ptr, tok_ptr, BLOCK_M)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_dim
        xt = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_a_slot + r[None, :] * stride_a_r + k[:, None],
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    tl.store(s_ptr + rows[:, None].to(tl.int64) * stride_s + r[None, :],
             acc.to(s_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(s_ptr, b_ptr, y_ptr, tok_ptr, seg_ptr, out_dim, rank,
                        stride_s, stride_b_slot, stride_b_n, stride_y,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Grid (segments, row tiles, output tiles): y[tok[rows], n] += s[rows] @ B[slot, n]^T."""
    slot, rows, row_ok, tok = _segment_rows(seg_ptr, tok_ptr, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        st = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * stride_b_slot + n[None, :] * stride_b_n + r[:, None],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(st, bt, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & n_ok[None, :]
    y_at = y_ptr + tok[:, None] * stride_y + n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              token_index: torch.Tensor, segment_table: torch.Tensor,
              max_segment_len: int) -> torch.Tensor:
    """``y[t] += (x[t] A[s]^T) B[s]^T`` for every adapted token ``t`` of slot ``s`` (in place).

    Args:
        y: [T, out] the base layer's output, unit-stride rows (updated in place and returned).
        x: [T, in] the layer's input, the dtype of ``lora_a``/``lora_b`` (fp16/bf16/fp32).
        lora_a: [max_loras, R, in]; lora_b: [max_loras, out, R] (scaling folded in), both
            unit stride in the last dim.
        token_index: int64 [N] adapted tokens' rows of ``x``/``y``, grouped by slot, each once.
        segment_table: int32 [S, 3] (slot, start, end) per segment over ``token_index``.
        max_segment_len: the longest segment's ``end - start`` (sizes the grid).

    Returns:
        ``y``.

    Raises:
        ValueError: on mismatched dtypes or shapes, or non-unit-stride rows.
    """
    _check(y, x, lora_a, lora_b, segment_table)
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, rank = token_index.shape[0], lora_a.shape[1]
    if num_tokens == 0 or rank == 0:
        return y
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    shrunk = torch.empty(num_tokens, rank, dtype=x.dtype, device=x.device)
    row_tiles, segments = triton.cdiv(max_segment_len, _BLOCK_M), segment_table.shape[0]
    _sgmv_shrink_kernel[(segments, row_tiles, triton.cdiv(rank, _BLOCK_R))](
        x, lora_a, shrunk, token_index, segment_table, x.shape[1], rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K, DOT_PRECISION=precision,
        num_warps=4)
    _sgmv_expand_kernel[(segments, row_tiles, triton.cdiv(y.shape[1], _BLOCK_N))](
        shrunk, lora_b, y, token_index, segment_table, y.shape[1], rank,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_R=_BLOCK_R, BLOCK_N=_BLOCK_N, DOT_PRECISION=precision,
        num_warps=4)
    return y


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           segment_table: torch.Tensor) -> None:
    """Raise ValueError unless the operands fit :func:`sgmv_lora`."""
    if not (x.dtype == lora_a.dtype == lora_b.dtype):
        raise ValueError(f"x, lora_a and lora_b must share a dtype, got {x.dtype}, "
                         f"{lora_a.dtype}, {lora_b.dtype}")
    if lora_a.shape[2] != x.shape[1] or lora_b.shape[1] != y.shape[1] \
            or lora_b.shape[2] != lora_a.shape[1] or y.shape[0] != x.shape[0]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, lora_a "
                         f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, y "
                         f"{tuple(y.shape)}")
    if y.stride(-1) != 1 or lora_a.stride(-1) != 1 or lora_b.stride(-1) != 1:
        raise ValueError("y, lora_a and lora_b need unit-stride rows")
    if segment_table.dtype != torch.int32 or segment_table.dim() != 2 \
            or segment_table.shape[1] != 3:
        raise ValueError("segment_table must be int32 [S, 3] (slot, start, end)")
