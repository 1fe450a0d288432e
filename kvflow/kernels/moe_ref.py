"""Grouped SwiGLU experts in plain torch: the CPU path of ``FusedMoE`` and the reference
that the Triton grouped-GEMM kernels (``kernels/moe.py``) are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.kernels.gemm import GemmWorkspace, linear


def fused_experts_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      workspace: GemmWorkspace | None = None) -> torch.Tensor:
    """Grouped SwiGLU experts in plain torch (the CPU path and the kernels' reference).

    Each expert computes ``down(silu(gate(x)) * up(x))`` on the rows routed to it; the rows are
    sorted by expert so every expert reads one contiguous slice (one matmul per expert that got
    tokens, none for the others). Products are summed per token in float32 and rounded once.
    The loop is over experts, never tokens; on CPU it beats a padded ``bmm`` over all E experts,
    which would read every expert's weights even in decode steps that touch only a few.

    Args:
        hidden: [T, H] activations.
        w13: [E, 2*I, H] gate rows then up rows per expert, ``hidden.dtype``.
        w2: [E, H, I] down projection per expert.
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] integer expert ids in [0, E]; id E means "no expert here" (a pair
            that expert parallelism routed to another rank): skipped, contributes nothing.
        workspace: run 16-bit GEMMs on fp32 units (see :func:`kvflow.kernels.gemm.linear`).

    Returns:
        [T, H] in ``hidden.dtype``.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    token_of_row = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0] + 1).tolist()[:w13.shape[0]]
    order = order[:sum(counts)]  # id E (not on this rank) sorts last: drop those pairs
    token_of_row = token_of_row[:order.shape[0]]
    x = hidden[token_of_row]  # [rows, H], rows of expert 0 first, then expert 1, ...
    out = torch.empty(x.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate, up = linear(x[rows], w13[expert], None, workspace).chunk(2, dim=-1)
            out[rows] = linear(F.silu(gate) * up, w2[expert], None, workspace)
            start += count
    weighted = out.float() * topk_weights.reshape(-1)[order].unsqueeze(-1)
    combined = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return combined.index_add_(0, token_of_row, weighted).to(hidden.dtype)
