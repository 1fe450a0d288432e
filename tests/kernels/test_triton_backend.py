"""TritonPagedAttentionBackend.forward (store + attend) vs the torch references.

Tolerance (fp32, CPU interpreter): atol=rtol=1e-4; bf16 (GPU): atol=rtol=2e-2.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.triton_paged import TritonPagedAttentionBackend
from kvflow.kernels.kv_store import store_kvcache_ref
from kvflow.kernels.paged_attention import paged_attention_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _step(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, num_pad, seed):
    """One engine step: ``reqs = [(cached_len, new_len)]``; returns inputs and metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in reqs]
    nblocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(reqs), max(nblocks), dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    slots = []
    for i, ((cached, new), nb) in enumerate(zip(reqs, nblocks)):
        table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        for pos in range(cached, cached + new):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * num_pad  # padded tokens at the end of the batch
    num_tokens = len(slots)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    q_lens = [n for _, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(
            [0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_actual_tokens=num_tokens - num_pad,
    )
    tensors = [t.to(device=DEVICE, dtype=dtype) for t in (q, k, v, kv_cache)]
    return (*tensors, meta)


def _check(reqs, num_heads, num_kv_heads, head_dim, dtype, tol, window=None, num_pad=3, seed=0):
    q, k, v, kv_cache, meta = _step(
        reqs, num_heads, num_kv_heads, head_dim, 16, dtype, num_pad, seed
    )
    ref_cache = kv_cache.clone()
    store_kvcache_ref(k, v, ref_cache, meta.slot_mapping)
    ref = paged_attention_ref(
        q,
        ref_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.max_query_len,
        meta.max_seq_len,
        head_dim**-0.5,
        sliding_window=window,
    )
    backend = TritonPagedAttentionBackend()
    assert backend.name == "triton"
    backend.prepare(meta, 16)
    out = backend.forward(q, k, v, kv_cache, meta, head_dim**-0.5, sliding_window=window)
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **tol)


@pytest.mark.parametrize("window", [None, 12])
def test_backend_mixed_step(window):
    reqs = [(0, 19), (40, 1), (7, 12), (16, 1)]
    _check(reqs, 6, 2, 64, torch.float32, {"atol": 1e-4, "rtol": 1e-4}, window=window)


def test_backend_decode_step():
    _check(
        [(100, 1), (3, 1), (31, 1)],
        4,
        4,
        128,
        torch.float32,
        {"atol": 1e-4, "rtol": 1e-4},
        num_pad=1,
        seed=1,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_backend_bf16():
    reqs = [(0, 1024), (2000, 300)] + [(c, 1) for c in range(100, 4000, 157)]
    _check(reqs, 32, 8, 128, torch.bfloat16, {"atol": 2e-2, "rtol": 2e-2}, num_pad=8, seed=2)
