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
    plan_paged_attention,
)
from tests.kernels.paged_batch import make_batch as make_cpu_batch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CPU_TOL = {"atol": 1e-4, "rtol": 1e-4}
GPU_TOL = {"atol": 2e-2, "rtol": 2e-2}


def make_batch(*args, **kwargs):
    return make_cpu_batch(*args, device=DEVICE, **kwargs)


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


def test_plan_paged_attention_hand_computed():
    # mixed batch: 10 tokens, 3 requests, GQA 8:2 -> QPKV 4, 20 rows > 16 -> prefill tiles of
    # 64 rows = 16 tokens; q-blocks 10 // 16 + 3 = 3; a prefill chunk never splits
    plan = plan_paged_attention(10, 8, 2, 64, 3, 5, 100, num_sms=132)
    assert (plan.qpkv, plan.block_d, plan.block_m, plan.block_q) == (4, 64, 64, 16)
    assert (plan.tile_n, plan.num_warps, plan.num_stages) == (64, 4, 2)
    assert plan.num_splits == 1 and plan.grid == (3, 2, 1)
    # all-decode, 2 requests x 8 KV heads on 132 SMs, 4096 keys: 16 splits, head_dim 256 ->
    # BLOCK_D 256, tiles of 32 keys, 16 rows (one token per program)
    plan = plan_paged_attention(2, 8, 8, 256, 2, 1, 4096, num_sms=132)
    assert (plan.block_d, plan.block_m, plan.block_q, plan.tile_n) == (256, 16, 16, 32)
    assert plan.num_splits == MAX_SPLITS and plan.grid == (2, 8, MAX_SPLITS)
    assert plan_paged_attention(2, 8, 8, 256, 2, 1, 4096, 132, num_splits=3).grid == (2, 8, 3)


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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size",
                         [(80, 8, 1, 16), (96, 8, 8, 32), (112, 32, 4, 16), (192, 16, 2, 32)])
def test_gpu_edge_shapes_bf16(head_dim, num_heads, num_kv_heads, block_size):
    """bf16 (which Triton's interpreter cannot run: its tl.dot multiplies bf16 bit patterns,
    triton-lang/triton#11584) on head dims that are not powers of two, GQA 1/4/8 and one KV
    head, contexts of 1, block_size - 1, block_size, block_size + 1 and a mixed batch, split
    and not. Written without a GPU run (session 19)."""
    b = block_size
    reqs = [(0, 1), (0, b - 1), (0, b), (0, b + 1), (b - 1, 1), (b, 1), (b + 1, 1), (700, 1),
            (3 * b, 2 * b + 3)]
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size=block_size,
                       dtype=torch.bfloat16, seed=11)
    for num_splits in (None, 1, 4):
        check(batch, GPU_TOL, num_splits=num_splits)

