"""Reference paged attention in plain torch (the CPU backend).

Per step, ``prepare`` builds one boolean mask ``[num_reqs, 1, max_query_len, kv_len]`` (causal,
padding and sliding window folded in; ``kv_len`` = block-table width x block_size). Per layer,
``forward`` scatters the new K/V into the cache through ``slot_mapping``, gathers every
request's K/V *whole blocks at a time* through its block table (``index_select`` of
``block_size``-token rows: on CPU this copy is several times faster than a per-token gather),
pads the queries to ``[num_reqs, heads, max_query_len, head_dim]`` and calls
``scaled_dot_product_attention``. All K/V, cached prefix and new tokens alike, come from the
paged cache.

A quantized cache (``--kv-cache-dtype int8|fp8_e4m3``, ``kv_scales`` given) is written through
:func:`kvflow.kernels.kv_quant.quantize_kv` and its gathered blocks are dequantized to the
query dtype before SDPA; a batch of whole prompts attends to the new K/V as the cache will give
them back (quantized and dequantized), so every path sees the same keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its uint8 bits (same storage); other tensors unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float, soft_cap: float | None = None) -> torch.Tensor:
    """Masked attention of q [B, Hq, Lq, D] over keys / values [B, Hkv, Lk, D] (query head
    ``h`` reads KV head ``h // (Hq / Hkv)``), mask bool [B, 1, Lq, Lk] (True: attend) ->
    [B, Hq, Lq, D] in q's dtype: SDPA, or with ``soft_cap`` the product written out, as
    transformers' Gemma 2 computes it: scores ``q.k * scale`` soft-capped to
    ``soft_cap * tanh(scores / soft_cap)`` (Gemma 2 report, Gemma Team 2024, sec. 2), then
    masked, softmax in float32, cast back, times the values."""
    group = q.shape[1] // keys.shape[1]
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=group > 1)
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


class TorchPagedAttentionBackend(AttentionBackend):
    """Plain-torch paged attention (see the module doc); soft-caps attention logits
    (``logits_soft_cap``, Gemma 2) as the cpu and triton backends do."""

    name = "torch"
    supports_logits_soft_cap = True

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.seq_lens.device
        seq_lens = meta.seq_lens.long()
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        num_reqs, max_q = meta.num_reqs, meta.max_query_len
        kv_pos = torch.arange(meta.block_table.shape[1] * block_size, device=device)
        # Query j of request b sits at position seq_len - query_len + j.
        q_local = torch.arange(max_q, device=device)
        q_pos = (seq_lens - query_lens).unsqueeze(1) + q_local.unsqueeze(0)  # [B, max_q]
        mask = kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # causal, implies kv < seq_len
        valid_q = q_local.unsqueeze(0) < query_lens.unsqueeze(1)
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_local = torch.arange(meta.num_actual_tokens, device=device) - \
            meta.query_start_loc[:-1].long()[token_req]
        meta.extra = {
            "gather_blocks": meta.block_table.reshape(-1).long(),
            "mask": mask,
            "valid_q": valid_q,
            "q_dest": token_req * max_q + token_local,
            "window_q_pos": q_pos,
            "kv_pos": kv_pos,
            "uniform_prompts": self.uniform_prompts(meta),
        }

    @staticmethod
    def uniform_prompts(meta: AttentionMetadata) -> bool:
        """Whether the batch is whole prompts of one common length: those need no gather or
        mask, as the batch reshapes to [num_reqs, length, heads, head_dim] for causal SDPA."""
        if meta.max_query_len != meta.max_seq_len:  # a decode or a cached prefix (no syncs)
            return False
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        return bool((query_lens == meta.seq_lens).all()) \
            and bool((query_lens == meta.max_query_len).all())

    def _mask(self, meta: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, max_q, max_kv] bool, built once per step and window size."""
        ex = meta.extra
        key = ("mask", sliding_window)
        if key not in ex:
            mask = ex["mask"]
            if sliding_window is not None:
                recent = ex["kv_pos"].view(1, 1, -1) > (ex["window_q_pos"].unsqueeze(-1)
                                                         - sliding_window)
                mask = mask & recent
            # Padding query rows attend to key 0 so softmax stays finite; they are dropped.
            pad_rows = ~ex["valid_q"].unsqueeze(-1) & (ex["kv_pos"] == 0).view(1, 1, -1)
            ex[key] = (mask | pad_rows).unsqueeze(1)
        return ex[key]

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, kv_scales: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new K/V [T, Hkv, D] into ``kv_cache`` at ``meta.slot_mapping``
        (quantized, with their scales into ``kv_scales``, for an int8/fp8 cache).

        Returns:
            (k, v) as the cache gives them back: the inputs, or for a quantized cache their
            dequantized [num_actual_tokens, Hkv, D] values in ``k.dtype``.
        """
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        n = meta.num_actual_tokens
        slots = meta.slot_mapping[:n]
        stored = []
        for i, x in enumerate((k, v)):
            if kv_scales is None:
                kv_cache[i].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, x[:n])
                stored.append(x)
                continue
            q, scale = quantize_kv(x[:n], kv_cache.dtype)
            # through same-size integer views: CPU index_copy_ has no float8 kernel
            _bits(kv_cache[i]).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, _bits(q))
            kv_scales[i].view(-1, num_kv_heads).index_copy_(0, slots, scale)
            stored.append(dequantize_kv(q, scale, x.dtype))
        return stored[0], stored[1]

    @staticmethod
    def uniform_prompt_attention(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal SDPA for a batch of whole prompts of one length (``meta.extra
        ["uniform_prompts"]``): the new K/V are the whole context, so no cache read is needed."""
        n, num_heads, head_dim = meta.num_actual_tokens, q.shape[1], q.shape[2]
        num_reqs, max_q = meta.num_reqs, meta.max_query_len

        def batched(x: torch.Tensor) -> torch.Tensor:
            return x[:n].view(num_reqs, max_q, x.shape[1], head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True,
                                             scale=scale, enable_gqa=num_heads != k.shape[1])
        return out.transpose(1, 2).reshape(n, num_heads, head_dim)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, i: int,
                blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K (i = 0) or V (i = 1) of ``blocks``: [len(blocks), block_size, Hkv, D] in
        ``dtype`` (dequantized from an int8/fp8 cache)."""
        if kv_scales is None:
            return kv_cache[i].index_select(0, blocks)
        rows = _bits(kv_cache[i]).index_select(0, blocks).view(kv_cache.dtype)
        return dequantize_kv(rows, kv_scales[i].index_select(0, blocks), dtype)

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None, kv_scales=None,
                logits_soft_cap=None):
        """See :meth:`AttentionBackend.forward`; ``logits_soft_cap`` (None: none) soft-caps
        the scores (:func:`attend`), on the masked path only."""
        _num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        n = meta.num_actual_tokens
        k, v = self.store_kv(k, v, kv_cache, meta, kv_scales)
        ex = meta.extra
        num_reqs, max_q = meta.num_reqs, meta.max_query_len
        if ex["uniform_prompts"] and sliding_window is None and logits_soft_cap is None:
            return self.uniform_prompt_attention(q, k, v, meta, scale)
        keys, values = (self._gather(kv_cache, kv_scales, i, ex["gather_blocks"], q.dtype)
                        .view(num_reqs, -1, num_kv_heads, head_dim) for i in (0, 1))
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, kv_len, D]
        mask = self._mask(meta, sliding_window)  # [B, 1, max_q, kv_len]
        if max_q == 1:
            # Decode: the query heads sharing a KV head become that head's query rows
            # ([B, Hkv, group, D]; the one mask row broadcasts over them). Same product as
            # enable_gqa, but torch's CPU kernel runs it 4x faster in bf16 than one-row queries.
            q_fold = q[:n].reshape(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = attend(q_fold, keys, values, mask, scale, logits_soft_cap)
            return out.reshape(n, num_heads, head_dim)
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad[ex["q_dest"]] = q[:n]
        q_pad = q_pad.view(num_reqs, max_q, num_heads, head_dim).transpose(1, 2)
        out = attend(q_pad, keys, values, mask, scale, logits_soft_cap)
        out = out.transpose(1, 2).reshape(num_reqs * max_q, num_heads, head_dim)
        return out[ex["q_dest"]]
