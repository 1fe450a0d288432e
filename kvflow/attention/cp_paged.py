"""Context-parallel paged attention: every sequence's KV cache split over the CP ranks by
token, each rank's partial attention merged by log-sum-exp.

Layout: with ``N = context_parallel_size`` and KV block size ``B`` (``B % N == 0``), the
token at position ``p`` belongs to CP rank ``p % N``. A block id covers the same ``B``
positions on every rank, and each rank's cache block holds only its ``B / N`` of them::

    kv_cache (per rank): [2, num_blocks, B / N, num_kv_heads, head_dim]
    global slot s = block * B + p % B  ->  owner s % N, local slot s // N

so the engine (scheduler, KV-cache manager, prefix cache) sees ordinary ``B``-token blocks,
and each rank stores ``1 / N`` of every sequence's K/V (the pool holds ``N`` times the tokens
for the same bytes per rank).

Every rank runs the whole step (all query tokens through every dense layer, as TP ranks
do); attention is where the work splits (Ring Attention's blockwise formulation, Liu et al.
2023, arXiv:2310.01889; vLLM's decode context parallel keeps the KV the same way): each rank
scores all queries against only its own keys, giving a partial output ``o_r`` and its
log-sum-exp ``lse_r`` per query and head; the ranks exchange them (one all-gather) and every
rank combines them exactly (Milakov and Gimelshein 2018, "Online normalizer calculation for
softmax")::

    lse = logsumexp_r(lse_r),   o = sum_r exp(lse_r - lse) * o_r

Causality and sliding windows are masked in global positions. A query whose keys all live on
other ranks has ``lse_r = -inf`` and weight 0. Prefill chunks and decodes use the same path;
decode reads the distributed KV.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over a subset of the keys, with the subset's log-sum-exp.

    Args:
        q: [B, Hq, Q, D] queries.
        keys, values: [B, Hkv, K, D] (Hq % Hkv == 0: grouped-query attention).
        mask: bool [B, 1, Q, K]; True where the query may attend to the key.
        scale: softmax scale.

    Returns:
        (out [B, Hq, Q, D] float32, lse [B, Hq, Q] float32): ``out`` is the attention over
        the allowed keys (0 where a query has none), ``lse`` the log-sum-exp of its scaled
        scores (-inf where it has none).
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    return torch.matmul(probs, v), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into the attention over their union.

    Args:
        outs: [N, ...rows, D] float32 partial outputs.
        lses: [N, ...rows] float32 their log-sum-exps (-inf: no keys in that part).

    Returns:
        [...rows, D] float32: ``sum_r exp(lse_r - lse) * out_r`` with ``lse =
        logsumexp_r(lse_r)`` (every row must have a key in some part).
    """
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.unsqueeze(0))  # exp(-inf) = 0 for empty parts
    return (weights.unsqueeze(-1) * outs).sum(dim=0)


class ContextParallelAttentionBackend(AttentionBackend):
    """Paged attention over a KV cache split across the CP group (see the module docstring).

    Args:
        cp_group: the context-parallel ``CommGroup`` (``rank``, ``world_size``,
            ``all_gather``).
    """

    name = "context-parallel"
    supports_cuda_graphs = False

    def __init__(self, cp_group) -> None:
        self.cp = cp_group

    def local_block_size(self, block_size: int) -> int:
        """Tokens of one ``block_size`` block that this rank stores.

        Raises:
            ValueError: if ``block_size`` is not a multiple of the CP size.
        """
        if block_size % self.cp.world_size:
            raise ValueError(f"block_size={block_size} must be a multiple of "
                             f"context_parallel_size={self.cp.world_size}")
        return block_size // self.cp.world_size

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        n, rank, device = self.cp.world_size, self.cp.rank, meta.seq_lens.device
        local_bs = self.local_block_size(block_size)
        width = meta.block_table.shape[1]
        local = torch.arange(width * local_bs, device=device)
        kv_pos = (local // local_bs) * block_size + (local % local_bs) * n + rank
        seq_lens = meta.seq_lens.long()
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        q_local = torch.arange(meta.max_query_len, device=device)
        q_pos = (seq_lens - query_lens).unsqueeze(1) + q_local.unsqueeze(0)  # [B, max_q]
        token_req = torch.repeat_interleave(torch.arange(meta.num_reqs, device=device),
                                            query_lens)
        token_local = torch.arange(meta.num_actual_tokens, device=device) - \
            meta.query_start_loc[:-1].long()[token_req]
        slots = meta.slot_mapping[:meta.num_actual_tokens]
        own = torch.nonzero((slots >= 0) & (slots % n == rank)).flatten()
        meta.extra = {"kv_pos": kv_pos, "q_pos": q_pos,
                      "causal": kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1),
                      "q_dest": token_req * meta.max_query_len + token_local,
                      "own": own, "own_slots": slots[own] // n,
                      "gather_blocks": meta.block_table.reshape(-1).long()}

    def _mask(self, meta: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
        ex = meta.extra
        mask = ex["causal"]
        if sliding_window is not None:
            mask = mask & (ex["kv_pos"].view(1, 1, -1) > ex["q_pos"].unsqueeze(-1)
                           - sliding_window)
        return mask.unsqueeze(1)

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None, kv_scales=None):
        """See :meth:`AttentionBackend.forward`; ``kv_cache`` is this rank's part
        ([2, num_blocks, block_size / N, Hkv, D]).

        Raises:
            ValueError: for a quantized cache (not supported with context parallelism).
        """
        if kv_scales is not None:
            raise ValueError("context parallelism does not support a quantized KV cache")
        n, num_heads, head_dim = meta.num_actual_tokens, q.shape[1], q.shape[2]
        num_kv_heads, ex = k.shape[1], meta.extra
        for i, x in enumerate((k, v)):  # this rank's tokens only
            kv_cache[i].view(-1, num_kv_heads, head_dim).index_copy_(
                0, ex["own_slots"], x[ex["own"]])
        num_reqs, max_q = meta.num_reqs, meta.max_query_len
        keys, values = (kv_cache[i].index_select(0, ex["gather_blocks"])
                        .view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
                        for i in (0, 1))
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad[ex["q_dest"]] = q[:n]
        q_pad = q_pad.view(num_reqs, max_q, num_heads, head_dim).transpose(1, 2)
        out, lse = partial_attention(q_pad, keys, values, self._mask(meta, sliding_window),
                                     scale)
        out = out.transpose(1, 2).reshape(num_reqs * max_q, num_heads, head_dim)[ex["q_dest"]]
        lse = lse.transpose(1, 2).reshape(num_reqs * max_q, num_heads)[ex["q_dest"]]
        outs = self.cp.all_gather(out.unsqueeze(0), dim=0)  # [N, n, Hq, D]
        lses = self.cp.all_gather(lse.unsqueeze(0), dim=0)
        return merge_partials(outs, lses).to(q.dtype)
