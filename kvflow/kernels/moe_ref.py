"""Grouped SwiGLU experts in plain torch: the CPU path of ``FusedMoE`` and the reference
that the Triton grouped-GEMM kernels (``kernels/moe.py``) are tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.kernels.gemm import GemmWorkspace, linear


def fused_experts_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      workspace: GemmWorkspace | None = None) -> torch.Tensor:
    """Grouped SwiGLU experts in plain torch (the CPU path and the kernels' reference).

    Each expert computes ``down(silu(gate(x)) * up(x))`` on the rows routed to it (see
    :func:`grouped_experts`). On CPU this beats a padded ``bmm`` over all E experts, which
    would read every expert's weights even in decode steps that touch only a few.

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
    def expert_mlp(x: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = linear(x, w13[expert], None, workspace).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w2[expert], None, workspace)

    return grouped_experts(hidden, topk_weights, topk_ids, w13.shape[0], w2.shape[1],
                           expert_mlp)


def grouped_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_experts: int, out_features: int,
                    expert_mlp: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Route rows to experts, run each expert once on its rows, combine with the weights.

    The (token, slot) pairs are sorted by expert so every expert reads one contiguous slice
    (one call of ``expert_mlp`` per expert that got tokens, none for the others); products are
    summed per token in float32 and rounded once. The loop is over experts, never tokens.
    Pairs whose id is outside ``[0, num_experts)`` (routed elsewhere) contribute nothing.

    Args:
        hidden: [T, H] activations.
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] integer expert ids.
        num_experts: E.
        out_features: columns of ``expert_mlp``'s output (H).
        expert_mlp: ``(rows [n, H], expert) -> [n, out_features]`` in ``hidden.dtype``.

    Returns:
        [T, out_features] in ``hidden.dtype``.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    token_of_row = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    order = order[:sum(counts)]  # ids >= E (experts on other ranks) sort last: drop them
    token_of_row = token_of_row[:order.shape[0]]
    x = hidden[token_of_row]  # [rows, H], rows of expert 0 first, then expert 1, ...
    out = torch.empty(x.shape[0], out_features, dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out[rows] = expert_mlp(x[rows], expert)
            start += count
    weighted = out.float() * topk_weights.reshape(-1)[order].unsqueeze(-1)
    combined = torch.zeros(num_tokens, out_features, dtype=torch.float32,
                           device=hidden.device)
    return combined.index_add_(0, token_of_row, weighted).to(hidden.dtype)
