"""Plain-torch reference for paged attention (no Triton, no native code): the oracle every
attention kernel (Triton, native CPU) is tested against."""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Plain-torch reference for :func:`paged_attention`: a per-request loop in fp32.

    For each request: gather its ``seq_len`` keys/values through ``block_table``, repeat KV
    heads for GQA, build the causal (and sliding-window) mask for its query positions, softmax
    in fp32.  Padding rows of the result are zero.  Same arguments as :func:`paged_attention`
    (``max_query_len``/``max_seq_len`` are accepted for signature parity and ignored).
    ``softcap`` > 0 soft-caps the scores to ``softcap * tanh(scores / softcap)`` before the
    mask (Gemma 2's ``attn_logit_softcapping``; Gemma 2 report, sec. 2); 0 = off.
    """
    num_tokens, num_heads, head_dim = q.shape
    result = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end - start == 0:
            continue
        result[start:end] = _request_attention(q[start:end], kv_cache, block_table[i], seq_len,
                                                scale, sliding_window, softcap)
    result = result.to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def _request_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor,
                       seq_len: int, scale: float, sliding_window: int | None,
                       softcap: float) -> torch.Tensor:
    """One request's attention in fp32: its ``q_len`` queries ``q`` [q_len, Hq, D] (the
    last ``q_len`` of its ``seq_len`` positions) over the keys/values its ``block_row``
    (its block table row) maps, KV heads repeated for GQA, causal (and sliding-window) mask.

    Returns:
        [q_len, Hq, D] float32.
    """
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    qpkv = q.shape[1] // num_kv_heads
    q_len = q.shape[0]
    pos = torch.arange(seq_len, device=q.device)
    blocks = block_row[pos // block_size].long()
    k = kv_cache[0, blocks, pos % block_size].float()  # [seq_len, Hkv, D]
    v = kv_cache[1, blocks, pos % block_size].float()
    k = k.repeat_interleave(qpkv, dim=1)  # [seq_len, Hq, D]
    v = v.repeat_interleave(qpkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    visible = pos[None, :] <= q_pos[:, None]
    if sliding_window is not None and sliding_window > 0:
        visible &= q_pos[:, None] - pos[None, :] < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
