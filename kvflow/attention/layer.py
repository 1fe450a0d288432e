"""The attention layer used by every model, and the per-engine forward context it reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, MLAAttentionBackend
from kvflow.kernels.kv_quant import key_rotation, rotate_rows
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from kvflow.layers.rotary import RotaryEmbedding


class ForwardContext:
    """Holds the current step's AttentionMetadata, one per KV-cache group, for one engine's
    model.

    Scoped, not global: ``with ctx.bind(attn_metadata): model(...)`` sets it for the duration
    of one forward pass, refuses nesting, and always clears it, so two engines in one process
    each have their own context.
    """

    def __init__(self) -> None:
        self._attn_metadata: Sequence[AttentionMetadata] | None = None

    @contextmanager
    def bind(self, attn_metadata: Sequence[AttentionMetadata]
             ) -> Iterator[Sequence[AttentionMetadata]]:
        """Make ``attn_metadata`` (index = KV-cache group) current for one forward pass.

        Raises:
            RuntimeError: if a forward pass is already bound (nested forward passes).
        """
        if self._attn_metadata is not None:
            raise RuntimeError("ForwardContext.bind is already active (nested forward pass)")
        self._attn_metadata = attn_metadata
        try:
            yield attn_metadata
        finally:
            self._attn_metadata = None

    @property
    def attn_metadata(self) -> Sequence[AttentionMetadata]:
        """The bound metadata, one per KV-cache group.

        Raises:
            RuntimeError: outside ``bind`` (attention called without a step's metadata).
        """
        if self._attn_metadata is None:
            raise RuntimeError("attention called outside ForwardContext.bind")
        return self._attn_metadata


@dataclass
class AttentionContext:
    """What a model needs to build its attention layers: the backend (an MLA backend for a
    model whose attention is multi-head latent attention) and the forward context."""

    backend: AttentionBackend | MLAAttentionBackend
    forward_context: ForwardContext = field(default_factory=ForwardContext)


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (bound by the model runner as ``kv_cache``).

    Args:
        num_heads / num_kv_heads / head_dim: per TP rank.
        scale: softmax scale.
        ctx: the engine's attention context.
        sliding_window: tokens a query may look back (None = full attention).
        logits_soft_cap: ``cap`` of Gemma 2's soft-capped scores ``cap * tanh(s / cap)``
            (None: none); only a backend with ``supports_logits_soft_cap`` computes it.

    Raises:
        ValueError: for a ``logits_soft_cap`` the context's backend does not compute, naming
            the config field (``attn_logit_softcapping``) and the backend.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 ctx: AttentionContext, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if logits_soft_cap is not None and \
                not getattr(ctx.backend, "supports_logits_soft_cap", False):
            raise ValueError(
                f"attn_logit_softcapping={logits_soft_cap!r}: the {ctx.backend.name!r} "
                "attention backend does not soft-cap attention logits; leave "
                "--attention-backend unset or choose 'torch'")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # passed to the backend only when set (backends without soft-capping take no such arg)
        self._backend_kwargs = {} if logits_soft_cap is None else \
            {"logits_soft_cap": float(logits_soft_cap)}
        self._ctx = ctx
        self.kv_cache = torch.empty(0)
        self.kv_scales: torch.Tensor | None = None  # [2, blocks, block_size, Hkv] if quantized
        self.kv_group = 0  # index of this layer's KV-cache group (block table); set by the runner
        self._key_rotation: torch.Tensor | None = None  # INT8 cache: see rotate_for_int8_cache

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      scale_dtype: torch.dtype | None = None) -> KVCacheSpec:
        """This layer's KV-cache spec: full attention, or a sliding window (``scale_dtype``:
        a quantized cache's per-token-per-head scales, else None)."""
        shape = (block_size, self.num_kv_heads, self.head_dim, dtype, scale_dtype)
        if self.sliding_window is None:
            return FullAttentionSpec(*shape)
        return SlidingWindowSpec(*shape, window=self.sliding_window)

    def rotate_for_int8_cache(self, q: torch.Tensor, k: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q R, k R)`` with ``R`` the Hadamard rotation of
        :func:`kvflow.kernels.kv_quant.key_rotation` (QuaRot, arXiv:2404.00456): the scores
        ``q . k`` are unchanged and the INT8 cache stores rotated keys, whose outliers are
        spread over the whole head (see :mod:`kvflow.kernels.kv_quant`)."""
        rot = self._key_rotation
        if rot is None or rot.device != q.device:
            rot = self._key_rotation = key_rotation(self.head_dim).to(q.device)
        return rotate_rows(q, rot), rotate_rows(k, rot)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Over an INT8 cache, queries and keys
        are rotated first (:meth:`rotate_for_int8_cache`)."""
        meta = self._ctx.forward_context.attn_metadata[self.kv_group]
        if self.kv_scales is None:
            return self._ctx.backend.forward(q, k, v, self.kv_cache, meta, self.scale,
                                             self.sliding_window, **self._backend_kwargs)
        if self.kv_cache.dtype == torch.int8:
            q, k = self.rotate_for_int8_cache(q, k)
        return self._ctx.backend.forward(q, k, v, self.kv_cache, meta, self.scale,
                                         self.sliding_window, kv_scales=self.kv_scales,
                                         **self._backend_kwargs)

    def forward_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, rotary_emb: RotaryEmbedding) -> torch.Tensor:
        """Rotary embedding of q/k at ``positions``, then :meth:`forward`.

        When the backend fuses them (the Triton backend with ``KVFLOW_FUSED_KERNELS=1``:
        ``backend.fuse_rotary``) and ``rotary_emb.fusable`` takes the operands, the rotation
        and the KV-cache store run as one kernel (``backend.forward_rotary``); otherwise
        ``rotary_emb(positions, q, k)`` (its own per-device dispatch) then :meth:`forward`,
        which is also the path over an INT8 cache (its keys are Hadamard-rotated between the
        two, :meth:`rotate_for_int8_cache`). Same shapes as :meth:`forward`, plus positions
        int64 [T].
        """
        backend = self._ctx.backend
        if getattr(backend, "fuse_rotary", False) and self.kv_cache.dtype != torch.int8 \
                and rotary_emb.fusable(positions, q, k):
            meta = self._ctx.forward_context.attn_metadata[self.kv_group]
            return backend.forward_rotary(
                positions, q, k, v, (rotary_emb.cos_sin_cache, rotary_emb.is_neox_style),
                self.kv_cache, meta, self.scale, self.sliding_window, kv_scales=self.kv_scales,
                **self._backend_kwargs)
        q, k = rotary_emb(positions, q, k)
        return self(q, k, v)
