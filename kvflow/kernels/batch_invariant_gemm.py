"""A batch-invariant GEMM in Triton for ``--deterministic`` on CUDA: ``y = x @ W.T (+ bias)``
whose row ``i`` is bitwise the same whatever the other rows of ``x`` and however many there are.

cuBLAS picks its kernel, tile shape and split-K factor from M, N and K, so the same row is
summed in another order when the batch grows (He et al., "Defeating Nondeterminism in LLM
Inference", Thinking Machines Lab, 2025; their fix, like this one, is one fixed kernel
configuration). Here every launch uses the same tiles (``BLOCK_M`` x ``BLOCK_N`` outputs per
program, ``BLOCK_K`` deep steps), the same warps and stages, and no split-K: the program that
owns an output walks k from 0 to K in ``BLOCK_K`` steps and accumulates in fp32 with
``tl.dot``, so an output's reduction order depends on K alone. Only the grid grows with M.

Cost: the tile is sized for batches, so a decode step of a few rows computes (and throws away)
most of a 64-row tile; on a GPU this is expected to be slower than cuBLAS (Thinking Machines
report about 20% for their version). Checked here only in Triton's interpreter (numpy
products of fixed-shape tiles); the GPU build is not verified in this repository.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])  # the step's token count (only masks read it)
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one fixed order over k, whatever M
        k_idx = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_idx[None, :],
                    mask=(offs_m[:, None] < M) & (k_idx[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k_idx[:, None],
                    mask=(offs_n[None, :] < N) & (k_idx[:, None] < K), other=0.0)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with one fixed kernel configuration (see the module doc).

    Args:
        x: [..., K] fp32/bf16/fp16 (any device Triton runs on: CUDA, or the interpreter).
        weight: [N, K] in ``x``'s dtype, unit stride over K.
        bias: [N] or None (added in fp32).

    Returns:
        [..., N] float32: the fp32 accumulation, unrounded (the caller casts).

    Raises:
        ValueError: when the shapes or dtypes do not match.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype \
            or weight.stride(1) != 1 or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"batch_invariant_linear: x {tuple(x.shape)} {x.dtype} does not fit "
                         f"weight {tuple(weight.shape)} {weight.dtype} (unit stride over K)")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, (n, k) = rows.shape[0], weight.shape
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        b = bias.float().contiguous() if bias is not None else y
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _gemm_kernel[grid](rows, weight, b, y, m, n, k, rows.stride(0), weight.stride(0),
                           y.stride(0), HAS_BIAS=bias is not None,
                           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y.view(*x.shape[:-1], n)


class BatchInvariantWeight:
    """A weight [N, K] multiplied by :func:`batch_invariant_linear`; the ``packed_weight`` of a
    GEMM module under ``--deterministic`` on CUDA (same ``(x, bias) -> y`` call as the CPU
    packed weights; returns fp32, which :func:`kvflow.kernels.gemm.linear` casts)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return batch_invariant_linear(x.to(self.weight.dtype), self.weight, bias)
