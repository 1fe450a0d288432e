"""Random paged-attention batches shared by the attention-kernel tests."""

from __future__ import annotations

import torch


def make_batch(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    extra_tokens: int = 0,
    seed: int = 0,
    device: str = "cpu",
):
    """Build a paged batch from ``[(cached_prefix_len, query_len), ...]``.

    Physical blocks are a random permutation; every cache slot that holds no context token
    (free blocks, block tails, the block-table padding block) is NaN, so any read outside a
    request's context poisons the output.  ``extra_tokens`` padding rows are appended to q.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = perm.pop()  # a NaN block used as block-table padding
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    block_table = torch.full((len(reqs), max_blocks), pad_block, dtype=torch.int32)
    for i, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_req)):
        for j in range(nb):
            blk = perm.pop()
            block_table[i, j] = blk
            n = min(block_size, seq_len - j * block_size)
            kv_cache[:, blk, :n] = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
    q_lens = [q for _, q in reqs]
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens) + extra_tokens, num_heads, head_dim, generator=gen)
    return {
        "q": q.to(device=device, dtype=dtype),
        "kv_cache": kv_cache.to(device=device, dtype=dtype),
        "query_start_loc": query_start_loc.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "block_table": block_table.to(device),
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "scale": head_dim**-0.5,
    }


def attention_f64(batch: dict, sliding_window: int | None = None,
                  softcap: float = 0.0) -> torch.Tensor:
    """float64 oracle of paged attention over ``batch`` (:func:`make_batch`'s keys): per
    query token, softmax(q . K^T * scale) V over its causal (and sliding-window: keys in
    (pos - window, pos]) context, soft-capped (``softcap * tanh(s / softcap)``) when
    ``softcap`` > 0, every operand widened exactly to float64.

    Returns:
        float64 [num_tokens, num_heads, head_dim]; rows past ``query_start_loc[-1]`` zero.
    """
    q, cache = batch["q"].double(), batch["kv_cache"].double()
    block_size, group = cache.shape[2], q.shape[1] // cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = batch["query_start_loc"].tolist()
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        q_len = starts[r + 1] - starts[r]
        keys = torch.arange(seq_len)
        blocks = batch["block_table"][r, keys // block_size].long()
        k = cache[0, blocks, keys % block_size].repeat_interleave(group, 1)  # [S, H, D]
        v = cache[1, blocks, keys % block_size].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[starts[r]:starts[r + 1]], k) * batch["scale"]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = keys[None, :] <= pos
        if sliding_window:
            visible &= keys[None, :] > pos - sliding_window
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out[starts[r]:starts[r + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out
