"""Which of a step's tokens one context-parallel rank runs through the dense layers.

With Ring Attention (``kvflow.attention.cp_ring``) a prefill chunk is split over the CP
ranks: rank ``r`` runs only the chunk's tokens at positions ``p`` with ``p mod N == r`` (the
ones whose K/V it stores) through the embedding, the QKV/O projections, the MLP and the norms.
Decode tokens (one query token per request) are run by every rank, as without the split. A
:class:`TokenSplit` is that choice for one step, made once by the attention backend's
``prepare`` and read by the model runner: it selects the rank's inputs and, after the forward
pass, gathers the hidden states the step needs on every rank (the rows that sample) from the
ranks that computed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.distributed.comm import CommGroup


@dataclass
class TokenSplit:
    """One step's tokens as seen by one CP rank.

    Attributes:
        local: int64 [T_local], ascending: the step's token indices this rank runs.
        owner: int64 [T]: the CP rank that stores each token's K/V (position mod N); it runs
            that token whatever else runs it.
        cp: the context-parallel group.
    """

    local: torch.Tensor
    owner: torch.Tensor
    cp: CommGroup

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole step (every rank's)."""
        return self.owner.shape[0]

    def select(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's part of a per-token tensor whose ``dim`` indexes the step's tokens
        (input ids [T], positions [T] or M-RoPE's [3, T], embeddings [T, hidden])."""
        return x.index_select(dim, self.local)

    def gather(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The step's hidden states at ``rows``, on every rank, from the ranks that own them.

        Each row is taken from its owner rank (the others add zeros), summed by one
        all-reduce over the CP group of ``len(rows) x hidden`` elements: exact.

        Args:
            hidden: [T_local, H] this rank's final hidden states (``local``'s tokens).
            rows: int64 [K] step token indices wanted (the rows that sample); None: all.

        Returns:
            [T, H] in ``hidden``'s dtype: ``rows`` filled, every other row 0.
        """
        full = hidden.new_zeros(self.num_tokens, hidden.shape[-1])
        if rows is None:
            rows = torch.arange(self.num_tokens, device=hidden.device)
        if rows.numel() == 0:
            return full
        where = torch.full((self.num_tokens,), -1, dtype=torch.long, device=hidden.device)
        where[self.local] = torch.arange(self.local.shape[0], device=hidden.device)
        mine = self.owner[rows] == self.cp.rank
        part = hidden.new_zeros(rows.shape[0], hidden.shape[-1])
        part[mine] = hidden[where[rows[mine]]]
        full[rows] = self.cp.all_reduce(part)
        return full
