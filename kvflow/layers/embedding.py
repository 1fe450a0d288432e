"""Token embedding and LM head, split by vocabulary across TP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels.gemm import GemmPathMixin, linear


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab_size / tp_size, hidden]; out-of-shard ids embed to zero."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.shard_size = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(GemmPathMixin, VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab_size] (float32: with 16-bit weights the
        product's fp32 accumulation itself, never rounded to 16 bits)."""
        logits = linear(hidden, self.weight, None, self.gemm_workspace, self.packed_weight,
                        out_dtype=torch.float32)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, :self.vocab_size]
