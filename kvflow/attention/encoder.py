"""Bidirectional (non-causal) attention for encoder-only models such as BERT.

Why not the paged backends: in an encoder every token attends to every other token of its
sequence, later ones included, so the K/V of a position at layer >= 1 depend on the whole
sequence. Nothing can be cached for later steps or shared through the prefix cache, a prompt
cannot be split into chunks (a chunk would need K/V of tokens not computed yet), and there is
no decode that would read a cache. So an encoder's attention keeps no KV cache: each step
holds whole prompts only (the scheduler never chunks them), and each sequence attends over its
own tokens of the step with ``scaled_dot_product_attention`` (no mask: the sequence's tokens
are exactly its context). The scheduler still batches encoder requests like any others
(``query_start_loc`` of the step's metadata delimits them).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.layer import AttentionContext


class EncoderAttention(nn.Module):
    """Full bidirectional attention within each sequence of the step (no KV cache).

    Args:
        num_heads / head_dim: query (= key/value) heads and their size.
        scale: softmax scale.
        ctx: the engine's attention context (the step's ``query_start_loc``).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float,
                 ctx: AttentionContext) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self._ctx = ctx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v [T, H, D] (the step's whole sequences, back to back) -> [T, H, D]."""
        starts = self._ctx.forward_context.attn_metadata[0].query_start_loc.tolist()
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(starts):
            if end > start:
                seq = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [H, L, D]
                out[start:end] = F.scaled_dot_product_attention(
                    *seq, scale=self.scale).transpose(0, 1)
        return out
