"""Triton paged-attention backend: ``store_kvcache`` then one ``paged_attention`` launch.

Importing this module imports triton (through ``kvflow.kernels``); import it only when the
"triton" backend is requested.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.kernels.kv_store import store_kvcache
from kvflow.kernels.paged_attention import paged_attention


class TritonPagedAttentionBackend(AttentionBackend):
    """Mixed prefill/decode paged attention with Triton kernels (see
    :mod:`kvflow.kernels.paged_attention` for the single-pass / split-KV selection rule).

    Requirements: ``q``, ``k``, ``v`` and ``kv_cache`` share one float dtype (or the cache is
    int8/float8_e4m3fn with ``kv_scales``) and have a unit-stride last dim (token/head strides are free); ``meta.query_start_loc``,
    ``meta.seq_lens`` and ``meta.block_table`` are int32 on the same device.  No per-step
    preparation is needed, so ``prepare`` is the no-op default.
    """

    name = "triton"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; returns a fresh [T, Hq, D] tensor."""
        store_kvcache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return paged_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            sliding_window=sliding_window,
            kv_scales=kv_scales,
        )
