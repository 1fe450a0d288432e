"""Context-parallel paged attention: every sequence's KV cache split over the CP ranks by
token; prefill chunks split over the ranks with Ring Attention, decodes merged by log-sum-exp.

Layout: with ``N = context_parallel_size`` and KV block size ``B`` (``B % N == 0``), the
token at position ``p`` belongs to CP rank ``p % N``. A block id covers the same ``B``
positions on every rank, and each rank's cache block holds only its ``B / N`` of them::

    kv_cache (per rank): [2, num_blocks, B / N, num_kv_heads, head_dim]
    global slot s = block * B + p % B  ->  owner s % N, local slot s // N

so the engine (scheduler, KV-cache manager, prefix cache) sees ordinary ``B``-token blocks,
and each rank stores ``1 / N`` of every sequence's K/V (the pool holds ``N`` times the tokens
for the same bytes per rank).

A step's requests take one of two paths (``prepare`` decides; every rank decides the same):

* **prefill chunks** (more than one query token), with ``split_prefill``: split over the
  ranks. Rank ``r`` runs only the chunk's tokens it owns through the dense layers
  (:class:`~kvflow.attention.cp_split.TokenSplit`), writes their K/V into its cache, and
  attends their queries to every rank's K/V of the request, which travel around the ring
  (:func:`~kvflow.attention.cp_ring.ring_attention`: Ring Attention, Liu et al. 2023,
  arXiv:2310.01889; round-robin tokens balance the causal work as striped attention does).
  A chunk's K/V shard is what the rank holds of the whole context, earlier chunks included.
* **decodes** (one query token; every prefill chunk without ``split_prefill``): every rank
  runs the token through the dense layers, scores it against only its own keys, giving a
  partial output ``o_r`` and its log-sum-exp ``lse_r`` per head; one all-gather of those and
  every rank combines them exactly (Milakov and Gimelshein 2018, "Online normalizer
  calculation for softmax")::

      lse = logsumexp_r(lse_r),   o = sum_r exp(lse_r - lse) * o_r

  so decode reads the distributed KV, and every rank has the token's hidden state.

Causality and sliding windows are masked in global positions. A query whose keys all live on
other ranks has ``lse_r = -inf`` and weight 0.
"""

from __future__ import annotations

import time

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.attention.cp_ring import (
    merge_partials,
    partial_attention,
    ring_attention,
    window_mask,
)
from kvflow.attention.cp_split import TokenSplit


class ContextParallelAttentionBackend(AttentionBackend):
    """Paged attention over a KV cache split across the CP group (see the module docstring).

    Args:
        cp_group: the context-parallel ``CommGroup`` (``rank``, ``world_size``,
            ``all_gather``, ``all_reduce``, ``ring_shift``).
        split_prefill: split prefill chunks over the ranks (Ring Attention); False: every
            rank runs every token (the decode path for all of them).

    Attributes:
        attention_s: seconds this rank spent in ``forward`` (ring and all-gather waits
            included), since start-up.
    """

    name = "context-parallel"
    supports_cuda_graphs = False

    def __init__(self, cp_group, split_prefill: bool = True) -> None:
        self.cp = cp_group
        self.split_prefill = split_prefill
        self.attention_s = 0.0

    def local_block_size(self, block_size: int) -> int:
        """Tokens of one ``block_size`` block that this rank stores.

        Raises:
            ValueError: if ``block_size`` is not a multiple of the CP size.
        """
        if block_size % self.cp.world_size:
            raise ValueError(f"block_size={block_size} must be a multiple of "
                             f"context_parallel_size={self.cp.world_size}")
        return block_size // self.cp.world_size

    def token_split(self, meta: AttentionMetadata) -> TokenSplit | None:
        """The step's token split after ``prepare`` (None: this rank runs every token)."""
        return (meta.extra or {}).get("split")

    # ---- per step ----------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.seq_lens.device
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        token_req = torch.repeat_interleave(torch.arange(meta.num_reqs, device=device),
                                            query_lens)
        token_pos = (meta.seq_lens.long() - query_lens)[token_req] + \
            torch.arange(meta.num_actual_tokens, device=device) - \
            meta.query_start_loc[:-1].long()[token_req]
        ring_req = query_lens > 1 if self.split_prefill else torch.zeros_like(query_lens, dtype=torch.bool)
        if bool(ring_req.any()):
            self._prepare_split(meta, block_size, token_req, token_pos, ring_req)
        else:
            self._prepare_replicated(meta, block_size, token_req)

    def _kv_base(self, width: int, block_size: int, device: torch.device) -> torch.Tensor:
        """int64 [width * B / N]: the global position of each local slot of ``width`` blocks,
        less the owner rank (add ``r`` for rank ``r``'s slots)."""
        local_bs = self.local_block_size(block_size)
        local = torch.arange(width * local_bs, device=device)
        return (local // local_bs) * block_size + (local % local_bs) * self.cp.world_size

    def _own(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Which of ``slots`` (one per token this rank runs) this rank stores, and where."""
        n = self.cp.world_size
        own = torch.nonzero((slots >= 0) & (slots % n == self.cp.rank)).flatten()
        return {"own": own, "own_slots": slots[own] // n}

    def _prepare_replicated(self, meta: AttentionMetadata, block_size: int,
                            token_req: torch.Tensor) -> None:
        """Every token on every rank; each scores all queries against its own keys."""
        device = meta.seq_lens.device
        seq_lens = meta.seq_lens.long()
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        q_local = torch.arange(meta.max_query_len, device=device)
        q_pos = (seq_lens - query_lens).unsqueeze(1) + q_local.unsqueeze(0)  # [B, max_q]
        token_local = torch.arange(meta.num_actual_tokens, device=device) - \
            meta.query_start_loc[:-1].long()[token_req]
        kv_pos = self._kv_base(meta.block_table.shape[1], block_size, device) + self.cp.rank
        q_pos = q_pos.masked_fill(q_local.unsqueeze(0) >= query_lens.unsqueeze(1), -1)
        meta.extra = {"kv_pos": kv_pos, "q_pos": q_pos,
                      "q_dest": token_req * meta.max_query_len + token_local,
                      "gather_blocks": meta.block_table.reshape(-1).long(),
                      **self._own(meta.slot_mapping[:meta.num_actual_tokens])}

    def _prepare_split(self, meta: AttentionMetadata, block_size: int, token_req: torch.Tensor,
                       token_pos: torch.Tensor, ring_req: torch.Tensor) -> None:
        """Prefill chunks split over the ranks (their owned tokens here), decodes on all."""
        owner = token_pos % self.cp.world_size
        local = torch.nonzero(~ring_req[token_req] | (owner == self.cp.rank)).flatten()
        local_req, local_pos = token_req[local], token_pos[local]
        meta.extra = {"split": TokenSplit(local, owner, self.cp),
                      "ring": self._ring_layout(meta, block_size, ring_req, local_req,
                                                local_pos),
                      "decode": self._decode_layout(meta, block_size, ~ring_req, local_req)
                      if bool((~ring_req).any()) else None,
                      **self._own(meta.slot_mapping[:meta.num_actual_tokens][local])}

    def _ring_layout(self, meta: AttentionMetadata, block_size: int, ring_req: torch.Tensor,
                     local_req: torch.Tensor, local_pos: torch.Tensor) -> dict:
        """Where this rank's prefill queries go in the padded ``[R, M]`` query array (``R``
        requests, ``M`` queries each at most), their positions, and the blocks of the
        requests' context that this rank sends around the ring."""
        device = meta.seq_lens.device
        reqs = torch.nonzero(ring_req).flatten()
        rows = torch.nonzero(ring_req[local_req]).flatten()  # this rank's prefill tokens
        ring_index = (torch.cumsum(ring_req.long(), 0) - 1)[local_req[rows]]
        counts = torch.bincount(ring_index, minlength=reqs.shape[0])
        max_q = max(int(counts.max()), 1)
        slot = torch.arange(rows.shape[0], device=device) - (torch.cumsum(counts, 0) -
                                                            counts)[ring_index]
        q_dest = ring_index * max_q + slot
        q_pos = torch.full((reqs.shape[0] * max_q,), -1, dtype=torch.long, device=device)
        q_pos[q_dest] = local_pos[rows]
        width = -(-int(meta.seq_lens[reqs].max()) // block_size)
        return {"rows": rows, "q_dest": q_dest, "q_pos": q_pos.view(-1, max_q),
                "blocks": meta.block_table[reqs, :width].reshape(-1).long(),
                "kv_base": self._kv_base(width, block_size, device)}

    def _decode_layout(self, meta: AttentionMetadata, block_size: int, decode_req: torch.Tensor,
                       local_req: torch.Tensor) -> dict:
        """The decode tokens among this rank's (one per decode request, in request order),
        their positions, and the blocks of their context that this rank holds."""
        reqs = torch.nonzero(decode_req).flatten()
        width = -(-int(meta.seq_lens[reqs].max()) // block_size)
        return {"rows": torch.nonzero(decode_req[local_req]).flatten(),
                "q_pos": (meta.seq_lens[reqs].long() - 1).unsqueeze(1),
                "blocks": meta.block_table[reqs, :width].reshape(-1).long(),
                "kv_pos": self._kv_base(width, block_size, meta.seq_lens.device) + self.cp.rank}

    # ---- per layer ---------------------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None, kv_scales=None):
        """See :meth:`AttentionBackend.forward`; ``kv_cache`` is this rank's part
        ([2, num_blocks, block_size / N, Hkv, D]); ``q``/``k``/``v`` hold the tokens this
        rank runs (``token_split``'s, else the whole step's).

        Raises:
            ValueError: for a quantized cache (not supported with context parallelism).
        """
        if kv_scales is not None:
            raise ValueError("context parallelism does not support a quantized KV cache")
        start, ex = time.perf_counter(), meta.extra
        for i, x in enumerate((k, v)):  # this rank's tokens only
            kv_cache[i].view(-1, k.shape[1], k.shape[2]).index_copy_(
                0, ex["own_slots"], x[ex["own"]])
        if "split" in ex:
            out = q.new_empty(q.shape)
            self._ring_forward(out, q, kv_cache, ex["ring"], scale, sliding_window)
            if ex["decode"] is not None:
                self._decode_forward(out, q, kv_cache, ex["decode"], scale, sliding_window)
        else:
            out = self._replicated_forward(q, kv_cache, meta, scale, sliding_window)
        self.attention_s += time.perf_counter() - start
        return out

    def _context(self, kv_cache: torch.Tensor, blocks: torch.Tensor, num_reqs: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's keys and values of ``blocks`` (row-major [num_reqs, width]), as
        [num_reqs, Hkv, width * B / N, D] each."""
        hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
        return tuple(kv_cache[i].index_select(0, blocks).view(num_reqs, -1, hkv, d)
                     .transpose(1, 2) for i in (0, 1))

    def _ring_forward(self, out, q, kv_cache, ring: dict, scale, sliding_window) -> None:
        """Attention of this rank's prefill queries over every rank's keys (the ring)."""
        num_reqs, max_q = ring["q_pos"].shape
        q_pad = q.new_zeros(num_reqs * max_q, q.shape[1], q.shape[2])
        q_pad[ring["q_dest"]] = q[ring["rows"]]
        keys, values = self._context(kv_cache, ring["blocks"], num_reqs)
        kv_base = ring["kv_base"]
        attended = ring_attention(q_pad.view(num_reqs, max_q, *q.shape[1:]).transpose(1, 2),
                                  ring["q_pos"], keys, values, lambda src: kv_base + src,
                                  scale, sliding_window, self.cp)
        out[ring["rows"]] = attended.transpose(1, 2).reshape(num_reqs * max_q, *q.shape[1:])[
            ring["q_dest"]].to(q.dtype)

    def _decode_forward(self, out, q, kv_cache, dec: dict, scale, sliding_window) -> None:
        """Attention of the decode queries (on every rank): partial over this rank's keys,
        merged over the CP group by log-sum-exp."""
        rows = dec["rows"]
        keys, values = self._context(kv_cache, dec["blocks"], rows.shape[0])
        part, lse = partial_attention(q[rows].unsqueeze(2), keys, values,
                                      window_mask(dec["q_pos"], dec["kv_pos"], sliding_window),
                                      scale)  # [R, Hq, 1, D], [R, Hq, 1]
        outs = self.cp.all_gather(part[:, :, 0].unsqueeze(0), dim=0)
        lses = self.cp.all_gather(lse[:, :, 0].unsqueeze(0), dim=0)
        out[rows] = merge_partials(outs, lses).to(q.dtype)

    def _replicated_forward(self, q, kv_cache, meta, scale, sliding_window) -> torch.Tensor:
        """Every query of the step on every rank: partial over this rank's keys, merged over
        the CP group by log-sum-exp."""
        n, num_heads, head_dim = meta.num_actual_tokens, q.shape[1], q.shape[2]
        ex, num_reqs, max_q = meta.extra, meta.num_reqs, meta.max_query_len
        keys, values = self._context(kv_cache, ex["gather_blocks"], num_reqs)
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad[ex["q_dest"]] = q[:n]
        q_pad = q_pad.view(num_reqs, max_q, num_heads, head_dim).transpose(1, 2)
        out, lse = partial_attention(q_pad, keys, values,
                                     window_mask(ex["q_pos"], ex["kv_pos"], sliding_window),
                                     scale)
        out = out.transpose(1, 2).reshape(num_reqs * max_q, num_heads, head_dim)[ex["q_dest"]]
        lse = lse.transpose(1, 2).reshape(num_reqs * max_q, num_heads)[ex["q_dest"]]
        outs = self.cp.all_gather(out.unsqueeze(0), dim=0)  # [N, n, Hq, D]
        lses = self.cp.all_gather(lse.unsqueeze(0), dim=0)
        return merge_partials(outs, lses).to(q.dtype)
