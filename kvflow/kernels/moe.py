"""Grouped GEMM for Mixture-of-Experts layers: every expert's matmul in one launch.

The ``M = T * top_k`` (token, expert) rows are sorted by expert and each expert's group is
padded to a multiple of ``BLOCK_M`` (:func:`moe_align_block_size`), so every ``BLOCK_M`` tile
of rows belongs to exactly one expert. A program multiplies one row tile by one ``BLOCK_N``
column tile of that expert's weight, gathering input rows by index (the permutation is never
materialized) and scattering results to the rows' original positions. Experts that receive no
tokens own no tile; unused trailing tiles (the grid is sized for the worst case so there is no
host sync, which keeps the op CUDA-graph capturable) carry expert id -1 and exit at once.

:func:`fused_experts` chains two grouped GEMMs around SiLU-and-mul (gate_up, activation, down
with the routing weight applied in the fp32 accumulator) and sums each token's ``top_k`` rows
in fp32. The torch reference is :func:`fused_experts_ref` (one matmul per expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.activation import silu_and_mul
from kvflow.kernels.moe_ref import fused_experts_ref

__all__ = ["fused_experts", "fused_experts_ref", "grouped_gemm", "moe_align_block_size"]


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, expert) rows by expert, padding each expert's group to ``block_m`` rows.

    Args:
        topk_ids: [T, k] integer expert ids.
        num_experts: E.
        block_m: row-tile size of the GEMM.

    Returns:
        sorted_ids: [num_tiles * block_m] int32 indices into the flattened ``T*k`` rows, grouped
            by expert in id order (stable within an expert); padding slots hold ``T*k``.
        tile_expert: [num_tiles] int32 expert of each tile, -1 for unused tiles.
        ``num_tiles = cdiv(T*k, block_m) + min(E, T*k)`` bounds the padded total without
        reading the counts on the host.
    """
    flat = topk_ids.reshape(-1).long()
    m, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)  # expert e owns tiles [tile_end[e] - tiles[e], tile_end[e])
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(m, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    dest = (tile_end - tiles)[sorted_expert] * block_m + rank
    num_tiles = triton.cdiv(m, block_m) + min(num_experts, m)
    sorted_ids = torch.full((num_tiles * block_m,), m, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=device),
                                     right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


@triton.jit(do_not_specialize=["M"])  # T * top_k changes every step (only masks read it)
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, tile_expert_ptr,
                         M, N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Grid (num_tiles, cdiv(N, BLOCK_N)): C[r, n] = A[r // A_ROW_DIV] . B[expert(r), n]
    (times w[r] with MUL_WEIGHT) for the rows r of one expert tile."""
    pid_m = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    a_rows = rows // A_ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_base + kk[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: B[expert] is [N, K], read transposed
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 tile_expert: torch.Tensor, block_m: int, a_row_div: int = 1,
                 row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = a[r // a_row_div] @ b[expert(r)].T`` (times ``row_weights[r]``) for every
    row ``r`` listed in ``sorted_ids``; other rows of ``out`` are left untouched.

    Args:
        a: [rows_a, K] with unit-stride rows.
        b: [E, N, K] stacked expert weights, same dtype as ``a``.
        out: [M, N] output, unit-stride rows (``M = T * k``); fp32 or ``a.dtype``.
        sorted_ids / tile_expert: from :func:`moe_align_block_size` with the same ``block_m``.
        a_row_div: ``top_k`` when ``a`` holds one row per token, 1 when one row per (token, k).
        row_weights: optional [M] float32 factor applied in the fp32 accumulator.

    Returns:
        ``out``.

    Raises:
        ValueError: when ``a`` or ``out`` rows are not unit-stride.
    """
    if a.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("a and out need unit-stride rows")
    m, n = out.shape
    k = a.shape[1]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, row_weights if row_weights is not None else out, sorted_ids, tile_expert,
        m, n, k, a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=row_weights is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on grouped GEMMs; same contract as :func:`fused_experts_ref`.

    Args:
        hidden: [T, H] fp32/fp16/bf16.
        w13: [E, 2*I, H] (gate rows, then up rows), ``hidden.dtype``.
        w2: [E, H, I].
        topk_weights: [T, k] float32.
        topk_ids: [T, k] integer expert ids.

    Returns:
        [T, H] in ``hidden.dtype``.
    """
    num_tokens, top_k = topk_ids.shape
    m = num_tokens * top_k
    if m == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    block_m = 16 if m <= 256 else 64
    sorted_ids, tile_expert = moe_align_block_size(topk_ids, w13.shape[0], block_m)
    gate_up = torch.empty(m, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, w13, gate_up, sorted_ids, tile_expert, block_m, a_row_div=top_k)
    act = silu_and_mul(gate_up)  # [M, I]
    down = torch.empty(m, w2.shape[1], dtype=torch.float32, device=hidden.device)
    grouped_gemm(act, w2, down, sorted_ids, tile_expert, block_m,
                 row_weights=topk_weights.reshape(-1).float().contiguous())
    return down.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
