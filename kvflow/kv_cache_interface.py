"""How the KV cache is laid out: one spec per attention layer, grouped (pure data).

The model runner describes each attention layer's K/V with a ``KVCacheSpec`` (block shape,
dtype, attention span). The engine core groups layers with the same spec into KV-cache groups
(``kvflow/core/kv_cache_utils.py``), sizes the pool and sends the resulting ``KVCacheConfig``
back to the runner, which allocates the tensors; the KV-cache manager keeps one block table per
group. A new kind of attention (MLA's latent cache, a quantized cache, a draft model's layers)
is a new spec here plus, if its blocks live differently, a manager class in
``core/single_type_kv_cache_manager.py``.

A spec decides its tensor's shape (:meth:`KVCacheSpec.kv_cache_shape`): ``[2, num_blocks,
block_size, num_kv_heads, head_size]`` (0 = K, 1 = V) for full and sliding-window attention,
``[num_blocks, block_size, head_size]`` for MLA's latent cache (:class:`MLAAttentionSpec`).
Layer ``j`` of every group shares tensor ``j``, and a block id is owned by one group at a time,
so the groups never write the same slots.

A quantized cache (``--kv-cache-dtype int8|fp8_e4m3``: ``dtype`` int8 / float8_e4m3fn,
``scale_dtype`` float32) adds, beside each K/V tensor, its scales
(:meth:`KVCacheSpec.kv_scales_shape`: ``[2, num_blocks, block_size, num_kv_heads]``, one per
token and KV head, under the same block ids), counted in ``page_size_bytes``.

A speculative-decoding draft model's layers (names starting with ``DRAFT_LAYER_PREFIX``) form
``KVCacheConfig.draft_group``: tensors of their own, shaped by their own spec, addressed
through group 0's block table. A block id then holds both models' K/V of the same tokens, and
one block's bytes count both, so the draft's cache comes out of the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Names of a draft model's attention layers in ``get_kv_cache_spec`` start with this.
DRAFT_LAYER_PREFIX = "draft_model."


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV-cache block.

    Attributes:
        block_size: tokens per block.
        num_kv_heads: KV heads (per tensor-parallel rank).
        head_size: elements per head.
        dtype: element type of the cache.
        scale_dtype: type of the per-token, per-head scales of a quantized cache (None: the
            cache holds the values themselves).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer, K and V together, scales included."""
        per_head = self.head_size * self.dtype.itemsize
        if self.scale_dtype is not None:
            per_head += self.scale_dtype.itemsize
        return 2 * self.block_size * self.num_kv_heads * per_head

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor of ``num_blocks`` blocks (dtype ``self.dtype``):
        ``[2, num_blocks, block_size, num_kv_heads, head_size]``, 0 = K, 1 = V."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def kv_scales_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        """Shape of the scales beside a quantized cache tensor (dtype ``self.scale_dtype``):
        ``[2, num_blocks, block_size, num_kv_heads]``; None for an unquantized cache."""
        if self.scale_dtype is None:
            return None
        return (2, num_blocks, self.block_size, self.num_kv_heads)

    @property
    def sliding_window(self) -> int | None:
        """Keys a query may look back (tokens); None for full attention."""
        return None

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once in this layer's
        group, when a step computes at most ``max_num_batched_tokens`` tokens.

        Raises:
            NotImplementedError: on the base class (each kind of spec defines it).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no max_num_blocks")


KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtypes(kv_cache_dtype: str, model_dtype: torch.dtype
                    ) -> tuple[torch.dtype, torch.dtype | None]:
    """(cache dtype, scale dtype) for ``--kv-cache-dtype``: ``auto`` is the model dtype with
    no scales; ``int8`` / ``fp8_e4m3`` are quantized with float32 scales.

    Raises:
        ValueError: for an unknown name.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid; choose one of "
                         f"{sorted(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return (model_dtype, None) if dtype is None else (dtype, torch.float32)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to all earlier ones: a request holds all its blocks."""

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, sec. 2.1): a token's cache
    entry is one vector shared by every head, its normalized KV latent (``kv_lora_rank``
    values) followed by its rotated RoPE key (``qk_rope_head_dim`` values), so ``head_size`` is
    their sum and ``num_kv_heads`` is 1. There is no separate V: values are the latent part of
    the same vector. Blocks are held as in full attention.
    """

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: one latent vector per token."""
        return self.block_size * self.head_size * self.dtype.itemsize

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[num_blocks, block_size, head_size]``: latent then RoPE key, per token."""
        return (num_blocks, self.block_size, self.head_size)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A query at position p sees keys in (p - window, p] (Mistral; Gemma 3's local layers).

    Blocks that lie wholly before the window of every future query go back to the pool, so a
    request holds at most its window plus one step's chunk (rounded up), plus the block the
    window may straddle.

    Attributes:
        window: the sliding window in tokens.
    """

    window: int = 0

    @property
    def sliding_window(self) -> int | None:
        return self.window

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        in_window = -(-(self.window + max_num_batched_tokens) // self.block_size) + 1
        return min(-(-num_tokens // self.block_size), in_window)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at ``num_computed_tokens`` or later can see."""
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def first_needed_blocks(self, num_computed_tokens: np.ndarray) -> np.ndarray:
        """``first_needed_block`` of every entry: int64 [N] in, int64 [N] out."""
        return np.maximum(0, (num_computed_tokens - self.window + 1) // self.block_size)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table.

    Attributes:
        layer_names: the attention layers of the group (module paths), in model order.
        kv_cache_spec: the spec they all share.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id occupies across the group's layers (= across all KV tensors)."""
        return self.kv_cache_spec.page_size_bytes * len(self.layer_names)


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool the engine core sized, sent to the model runner to allocate.

    Attributes:
        num_blocks: blocks in the pool, including the reserved null block 0.
        kv_cache_groups: one entry per block table; every group has equally many layers
            (layer ``j`` of each group uses KV tensor ``j``).
        draft_group: a draft model's layers (speculative decoding), one tensor each, indexed
            by group 0's block ids; None without a draft model.
        num_host_blocks: blocks of the host pool that swapped-out requests' K/V are copied
            to (``--preemption-mode swap``; 0: none).
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    draft_group: KVCacheGroupSpec | None = None
    num_host_blocks: int = 0

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def num_tensors(self) -> int:
        """KV tensors to allocate: one per layer of a group."""
        return len(self.kv_cache_groups[0].layer_names)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id occupies across all KV tensors (the draft model's included)."""
        draft = self.draft_group.page_size_bytes if self.draft_group is not None else 0
        return self.kv_cache_groups[0].page_size_bytes + draft
