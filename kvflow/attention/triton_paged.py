"""Triton paged-attention backend: ``store_kvcache`` then one ``paged_attention`` launch, or,
with ``KVFLOW_FUSED_KERNELS=1``, the rotary embedding and the store fused into one launch
(:meth:`TritonPagedAttentionBackend.forward_rotary`).

Importing this module imports triton (through ``kvflow.kernels``); import it only when the
"triton" backend is requested.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.config.kernel_choices import fused_kernels_enabled
from kvflow.kernels.kv_store import store_kvcache
from kvflow.kernels.paged_attention import paged_attention
from kvflow.kernels.rotary_kv_store import rotary_store_kvcache


class TritonPagedAttentionBackend(AttentionBackend):
    """Mixed prefill/decode paged attention with Triton kernels (see
    :mod:`kvflow.kernels.paged_attention` for the single-pass / split-KV selection rule).

    Requirements: ``q``, ``k``, ``v`` and ``kv_cache`` share one float dtype (or the cache is
    int8/float8_e4m3fn with ``kv_scales``) and have a unit-stride last dim (token/head strides
    are free); ``meta.query_start_loc``, ``meta.seq_lens`` and ``meta.block_table`` are int32
    on the same device.  No per-step preparation is needed, so ``prepare`` is the no-op
    default.

    Args:
        fuse_rotary: whether :class:`~kvflow.attention.layer.Attention` may hand it the
            rotary embedding too (:meth:`forward_rotary`); default ``$KVFLOW_FUSED_KERNELS``.
        batch_invariant: one launch configuration for every batch (``--deterministic``; see
            :func:`kvflow.kernels.paged_attention.plan_paged_attention`).
    """

    name = "triton"
    supports_logits_soft_cap = True  # the kernel's softcap (Gemma 2)
    supports_cuda_graphs = True  # no host syncs, grids fixed by the batch size, no prepare

    def __init__(self, fuse_rotary: bool | None = None, batch_invariant: bool = False) -> None:
        self.fuse_rotary = fused_kernels_enabled() if fuse_rotary is None else fuse_rotary
        self.batch_invariant = batch_invariant

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
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; returns a fresh [T, Hq, D] tensor.
        ``logits_soft_cap`` (None: none) soft-caps the scores (Gemma 2)."""
        store_kvcache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self._attend(q, kv_cache, meta, scale, sliding_window, kv_scales,
                            logits_soft_cap)

    def forward_rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, bool],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Rotary embedding of ``q``/``k`` (in place) and the KV store in one launch
        (:func:`kvflow.kernels.rotary_kv_store.rotary_store_kvcache`), then attention: the
        same result as ``forward`` on the rotated ``q``/``k``.

        Args:
            positions: int64 [T] token positions.
            rotary: ``(cos_sin_cache [max_pos, rot_dim] float32, is_neox)``.
            others: as :meth:`forward`.

        Returns:
            [T, Hq, D], a fresh tensor.
        """
        cos_sin_cache, is_neox = rotary
        rotary_store_kvcache(positions, q, k, v, cos_sin_cache, is_neox, kv_cache,
                             meta.slot_mapping, kv_scales)
        return self._attend(q, kv_cache, meta, scale, sliding_window, kv_scales,
                            logits_soft_cap)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None,
                kv_scales: torch.Tensor | None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
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
            batch_invariant=self.batch_invariant,
            softcap=float(logits_soft_cap or 0.0),
        )
