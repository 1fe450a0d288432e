"""Triton paged attention vs the per-request torch reference.

CPU (TRITON_INTERPRET=1, fp32): tolerance atol=rtol=1e-4 (fp32 everywhere; only summation
order differs).  GPU (bf16, realistic shapes): atol=rtol=2e-2 against the fp32 reference
rounded to bf16 (bf16 P-matrix rounding before the PV matmul dominates the error).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.paged_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CPU_TOL = {"atol": 1e-4, "rtol": 1e-4}
GPU_TOL = {"atol": 2e-2, "rtol": 2e-2}


def make_batch(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    extra_tokens: int = 0,
    seed: int = 0,
    device: str = DEVICE,
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


def check(batch, tol, num_splits=None, sliding_window=None):
    n_real = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**batch, sliding_window=sliding_window)
    out = paged_attention(**batch, sliding_window=sliding_window, num_splits=num_splits)
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    torch.testing.assert_close(out[:n_real].float(), ref[:n_real].float(), **tol)


# Ragged mixed batch: fresh prefill, decodes, chunks with a cached prefix, block crossings.
MIXED = [(0, 5), (33, 1), (10, 20), (0, 1), (47, 17), (15, 1)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)])
def test_mixed_batch_single_pass(num_heads, num_kv_heads, head_dim):
    check(make_batch(MIXED, num_heads, num_kv_heads, head_dim), CPU_TOL, num_splits=1)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 1, 64), (6, 2, 128)])
def test_mixed_batch_split_forced(num_heads, num_kv_heads, head_dim):
    check(make_batch(MIXED, num_heads, num_kv_heads, head_dim), CPU_TOL, num_splits=3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_batch(head_dim, num_splits):
    # Long-ish and short contexts; 4 splits over 1..5 tiles leaves some splits empty.
    reqs = [(300, 1), (16, 1), (63, 1), (129, 1)]
    num_heads = 6 if head_dim == 64 else 8  # GQA ratio 3 and 4
    check(make_batch(reqs, num_heads, 2, head_dim, seed=1), CPU_TOL, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window", [7, 40])
def test_sliding_window(window, num_splits):
    reqs = [(0, 24), (70, 1), (50, 9), (130, 1)]
    batch = make_batch(reqs, 6, 2, 64, seed=2)
    check(batch, CPU_TOL, num_splits=num_splits, sliding_window=window)


def test_padding_rows_and_empty_request():
    # Extra padding rows after the last request and a request with no query tokens.
    reqs = [(9, 3), (20, 0), (0, 18), (5, 1)]
    batch = make_batch(reqs, 4, 2, 64, extra_tokens=5, seed=3)
    out = paged_attention(**batch)
    ref = paged_attention_ref(**batch)
    torch.testing.assert_close(out[:22], ref[:22], **CPU_TOL)


@pytest.mark.parametrize("block_size,head_dim", [(8, 80), (32, 64)])
def test_other_block_sizes_and_head_dims(block_size, head_dim):
    check(make_batch(MIXED, 4, 2, head_dim, block_size=block_size, seed=4), CPU_TOL)


def test_strided_q_and_preallocated_out():
    batch = make_batch(MIXED, 4, 2, 64, seed=5)
    q = batch["q"]
    fused = torch.randn(q.shape[0], q.shape[1] + 4, q.shape[2], device=q.device)
    fused[:, :4] = q  # q as a non-contiguous view (like a slice of a fused QKV output)
    batch["q"] = fused[:, :4]
    out = torch.zeros_like(q)
    res = paged_attention(**batch, out=out)
    assert res is out
    torch.testing.assert_close(out, paged_attention_ref(**batch), **CPU_TOL)


def test_choose_num_splits_rule():
    assert choose_num_splits(5, 4096, 1, 8, 132) == 1  # has a prefill chunk
    assert choose_num_splits(1, 256, 1, 8, 132) == 1  # short context
    assert choose_num_splits(1, 4096, 64, 8, 132) == 1  # grid already fills the GPU
    assert choose_num_splits(1, 4096, 1, 8, 132) == MAX_SPLITS
    assert choose_num_splits(1, 4096, 8, 8, 132) == 5  # ceil(264 / 64)
    assert choose_num_splits(1, 600, 1, 8, 132) == 3  # ceil(600 / 256) keys per split


def test_bad_arguments():
    batch = make_batch([(0, 3)], 4, 2, 64)
    with pytest.raises(ValueError):
        paged_attention(**batch, num_splits=0)
    batch["q"] = batch["q"][:, :3]
    with pytest.raises(ValueError):
        paged_attention(**batch)


# --------------------------------------------------------------------------- GPU (bf16)


def _gpu_reqs(seed: int, num_decodes: int, max_ctx: int = 4096):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (num_decodes,), generator=gen).tolist()
    return [(c, 1) for c in ctx]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_mixed_bf16(window):
    reqs = [(0, 512), (1000, 256), (3000, 77)] + _gpu_reqs(0, 30)
    batch = make_batch(reqs, 32, 8, 128, dtype=torch.bfloat16, seed=10)
    check(batch, GPU_TOL, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_decode_bf16(num_splits, head_dim):
    batch = make_batch(_gpu_reqs(1, 4) + [(4095, 1)], 32, 8, head_dim, dtype=torch.bfloat16)
    check(batch, GPU_TOL, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_prefill_only_bf16():
    batch = make_batch([(0, 2048), (0, 1000), (512, 1500)], 32, 8, 128, dtype=torch.bfloat16)
    check(batch, GPU_TOL)
