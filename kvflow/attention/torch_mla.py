"""Paged multi-head latent attention in plain torch (the MLA backend on every device).

Absorbed form (see :mod:`kvflow.attention.mla`): per layer, ``forward`` scatters the step's new
latent vectors into the cache through ``slot_mapping``, gathers every request's cached vectors
whole blocks at a time through its block table (one vector per token, ``[num_reqs, 1, kv_len,
kv_lora_rank + rope]``), and calls ``scaled_dot_product_attention`` with that one KV head as the
key and its first ``kv_lora_rank`` values as the value. The query heads are folded into query
rows (``[num_reqs, 1, max_query_len * num_heads, D]``), so the single KV head is never copied per
head, as ``enable_gqa`` would. The per-step mask and gather indices are the plain torch paged
backend's (:class:`~kvflow.attention.torch_paged.TorchPagedAttentionBackend`).

Why absorbed everywhere: a decode token then costs ``num_heads x context x (2 x kv_lora_rank +
rope)`` multiply-adds over the cache as stored, with no per-step up-projection of the context
into per-head keys and values (``context x kv_lora_rank x num_heads x (nope + v)``, more than
the attention itself). Long prefill chunks would spend fewer FLOPs in the expanded form when
``kv_lora_rank`` exceeds ``qk_nope_head_dim + v_head_dim`` (DeepSeek-V2/V3: 512 vs 256); that
split (vLLM runs prefills expanded, decodes absorbed) is not implemented here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionMetadata, MLAAttentionBackend
from kvflow.attention.torch_paged import TorchPagedAttentionBackend


class TorchMLABackend(MLAAttentionBackend):
    """MLA for mixed prefill/decode batches in plain torch (see the module docstring)."""

    name = "torch_mla"

    def __init__(self) -> None:
        self._paged = TorchPagedAttentionBackend()

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """The paged torch backend's per-step gather indices and causal/padding mask."""
        self._paged.prepare(meta, block_size)

    @staticmethod
    def store_latent(kv_c: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the step's new vectors kv_c [T, D] into ``kv_cache`` [num_blocks, block_size,
        D] at ``meta.slot_mapping``."""
        n = meta.num_actual_tokens
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, meta.slot_mapping[:n], kv_c[:n])

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """See :meth:`MLAAttentionBackend.forward`; returns a fresh [T, H, kv_lora_rank]."""
        self.store_latent(kv_c, kv_cache, meta)
        n, num_heads, dim = meta.num_actual_tokens, q.shape[1], q.shape[2]
        num_reqs, max_q = meta.num_reqs, meta.max_query_len
        ex = meta.extra
        keys = kv_cache.index_select(0, ex["gather_blocks"]).view(num_reqs, 1, -1, dim)
        values = keys[..., :kv_lora_rank]
        mask = self._paged._mask(meta, None)  # [B, 1, max_q, kv_len]
        if max_q == 1:  # decode: the heads are the query rows; the one mask row broadcasts
            out = F.scaled_dot_product_attention(q[:n].view(num_reqs, 1, num_heads, dim), keys,
                                                 values, attn_mask=mask, scale=scale)
            return out.view(n, num_heads, kv_lora_rank)
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, dim)
        q_pad[ex["q_dest"]] = q[:n]
        rows = q_pad.view(num_reqs, 1, max_q * num_heads, dim)  # row = (query token, head)
        row_mask = mask.unsqueeze(-2).expand(-1, -1, -1, num_heads, -1) \
            .reshape(num_reqs, 1, max_q * num_heads, -1)
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=row_mask, scale=scale)
        return out.view(num_reqs * max_q, num_heads, kv_lora_rank)[ex["q_dest"]]
