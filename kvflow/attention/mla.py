"""The multi-head latent attention (MLA) layer: DeepSeek-V2/V3's attention over a paged cache
of one latent vector per token.

MLA (DeepSeek-V2, arXiv:2405.04434, sec. 2.1) compresses each token's keys and values into a
latent ``c`` (``kv_lora_rank`` values, after RMSNorm) plus one RoPE key ``k_rope`` shared by all
heads. Head ``h``'s key is ``[c @ W_UK[h].T | k_rope]`` and its value ``c @ W_UV[h].T``. Since
``q_nope . (c @ W_UK[h].T) = (q_nope @ W_UK[h]) . c``, the up-projections can be absorbed
(paper, appendix; the "absorbed" or MQA form): the model feeds this layer
``q = [q_nope @ W_UK[h] | q_rope]`` per head and ``kv_c = [c | k_rope]`` per token, the layer
attends with one shared KV head whose value is the key's latent part, and the model applies
``W_UV`` to the attended latents. The cache therefore holds ``kv_lora_rank + qk_rope_head_dim``
values per token and layer (:class:`~kvflow.kv_cache_interface.MLAAttentionSpec`), and a
decode step reads each cached vector once for all heads without re-expanding anything.
"""

from __future__ import annotations

import torch

from kvflow.attention.layer import Attention, AttentionContext
from kvflow.kv_cache_interface import KVCacheSpec, MLAAttentionSpec


class MLAAttention(Attention):
    """Paged MLA in the absorbed form over this layer's latent cache (bound by the model
    runner as ``kv_cache``: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]).

    Args:
        num_heads: query heads per TP rank.
        kv_lora_rank: latent width (values per token and head after absorption).
        qk_rope_head_dim: RoPE key width, shared by all heads.
        scale: softmax scale.
        ctx: the engine's attention context; its backend must be an MLA backend.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float,
                 ctx: AttentionContext) -> None:
        super().__init__(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale, ctx)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      scale_dtype: torch.dtype | None = None) -> KVCacheSpec:
        """One latent vector per token: ``kv_lora_rank + qk_rope_head_dim`` values.

        Raises:
            ValueError: for a quantized cache (``scale_dtype`` set): not read by MLA yet.
        """
        if scale_dtype is not None:
            raise ValueError("--kv-cache-dtype int8/fp8_e4m3 is not supported for MLA "
                             "(DeepSeek) latent caches yet; use auto")
        return MLAAttentionSpec(block_size, 1, self.head_dim, dtype)

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """q [T, H, kv_lora_rank + rope] (absorbed no-RoPE part, then rotated RoPE part),
        kv_c [T, kv_lora_rank + rope] (normalized latent, then rotated RoPE key)
        -> [T, H, kv_lora_rank], the attention-weighted latents (``W_UV`` not yet applied)."""
        meta = self._ctx.forward_context.attn_metadata[self.kv_group]
        return self._ctx.backend.forward(q, kv_c, self.kv_cache, meta, self.scale,
                                         self.kv_lora_rank)
