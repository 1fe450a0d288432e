"""The attention backend interface and the per-step metadata every backend reads.

KV-cache layout (one tensor per layer)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
    kv_scales: [2, num_blocks, block_size, num_kv_heads] float32     (quantized caches only)

A token's *slot* is ``block_id * block_size + offset_in_block``.  New K/V are written through
``slot_mapping`` and all K/V (cached prefix and new tokens alike) are read back through
``block_table``; no backend keeps contiguous per-request KV.  The same call serves prefill
chunks and decodes in one batch: request ``i`` contributes the query tokens
``query_start_loc[i]:query_start_loc[i+1]``, which sit at the last ``query_len`` positions of
its ``seq_lens[i]`` context tokens and attend causally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one KV-cache group for one model step; built once per step per group
    (groups differ only in ``slot_mapping`` and ``block_table``), read by the group's layers.

    Attributes:
        slot_mapping: int64 [num_tokens]; KV slot for each new token (-1 = padding, skip).
        query_start_loc: int32 [num_reqs + 1]; cumulative query lengths (tokens).
        seq_lens: int32 [num_reqs]; context length per request after this step (tokens).
        block_table: int32 [num_reqs, max_num_blocks_per_req]; physical block ids, padded.
        max_query_len: longest query chunk in the batch (tokens).
        max_seq_len: longest context in the batch (tokens).
        num_actual_tokens: tokens that are real (the rest of the batch is padding).
        extra: backend-private tensors prepared once per step (e.g. gather indices).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    extra: dict | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes paged attention for a mixed batch of prefill chunks and decodes.

    A backend instance is shared by all layers of one model; ``prepare`` runs once per step.

    ``supports_cuda_graphs``: whether a decode step's forward may be captured in a CUDA graph
    and replayed (``worker/cuda_graphs.py``). Only a backend with no host syncs, launch grids
    fixed by the batch size, and a ``prepare`` that computes nothing from the step may say
    so: a captured graph runs ``prepare`` once, at capture time, and replays reuse what it
    made (the torch backend's causal mask, built from ``seq_lens``, would stay the one of
    contexts of length 1). Opt-in: False unless a backend sets it.

    ``supports_logits_soft_cap``: whether ``forward`` takes ``logits_soft_cap`` (Gemma 2's
    ``cap * tanh(q.k * scale / cap)`` before the softmax); the layer passes it only when set,
    and refuses a model that needs it on a backend without it.
    """

    name: str = "abstract"
    supports_cuda_graphs: bool = False
    supports_logits_soft_cap: bool = False

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Precompute per-step tensors (stored in ``meta.extra``); default: nothing."""

    @abstractmethod
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
        """Write ``k``/``v`` into ``kv_cache`` at ``meta.slot_mapping`` and attend.

        Args:
            q: [num_tokens, num_heads, head_dim], compute dtype.
            k, v: [num_tokens, num_kv_heads, head_dim]; num_heads % num_kv_heads == 0 (GQA).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place.
            meta: the step's AttentionMetadata.
            scale: softmax scale, usually head_dim ** -0.5.
            sliding_window: if set, a query at position p sees keys in (p - window, p].
            kv_scales: float32 [2, num_blocks, block_size, num_kv_heads] when ``kv_cache`` is
                quantized (int8 / float8_e4m3fn; ``kvflow/kernels/kv_quant.py``), else None.

        Returns:
            [num_tokens, num_heads, head_dim] attention output (padding rows unspecified).
        """


class MLAAttentionBackend(ABC):
    """Paged multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434) in the absorbed
    form, for a mixed batch of prefill chunks and decodes.

    The cache holds one vector per token, ``kv_c = [latent (kv_lora_rank) | k_rope]``
    (``kv_cache: [num_blocks, block_size, kv_lora_rank + rope_dim]``). Every query head attends
    to that one vector as its key and to its first ``kv_lora_rank`` values as its value: MQA with
    one KV head, whose value is a prefix of its key. The model folds the per-head up-projections
    into the queries and outputs (``W_UK`` into ``q``, ``W_UV`` after the output), so nothing
    per head is ever cached or rebuilt per step. A backend instance is shared by all MLA layers
    of one model; ``prepare`` runs once per step per KV-cache group.
    """

    name: str = "abstract-mla"
    supports_cuda_graphs: bool = False

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Precompute per-step tensors (stored in ``meta.extra``); default: nothing."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """Write ``kv_c`` into ``kv_cache`` at ``meta.slot_mapping`` and attend.

        Args:
            q: [num_tokens, num_heads, kv_lora_rank + rope_dim], compute dtype: each head's
                absorbed no-RoPE query (``q_nope @ W_UK``) then its rotated RoPE query.
            kv_c: [num_tokens, kv_lora_rank + rope_dim]: each new token's normalized latent,
                then its rotated RoPE key.
            kv_cache: [num_blocks, block_size, kv_lora_rank + rope_dim], updated in place.
            meta: the step's AttentionMetadata.
            scale: softmax scale (DeepSeek: ``qk_head_dim ** -0.5``, times YaRN's mscale^2).
            kv_lora_rank: the latent width (the value is the key's first ``kv_lora_rank``).

        Returns:
            [num_tokens, num_heads, kv_lora_rank]: attention-weighted latents, before ``W_UV``
            (padding rows unspecified).
        """
