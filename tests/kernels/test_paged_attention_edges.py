"""Triton paged attention (interpreter on CPU) on the edge shapes the CPU kernel tests cover,
against the float64 oracle ``attention_f64``: head dims 96/112/256 (BLOCK_D padding), GQA
groups that are not powers of two and MQA with 8 query heads per KV head (padded BLOCK_M
rows), odd cache block sizes, sliding windows of 1 and of a whole block under chunked prefill
with a cached prefix crossing blocks, a quantized (int8 / fp8) cache with window and split-KV
at once, the batch-invariant plan with window and soft cap, and empty requests (no query
tokens, or no context at all) between real ones plus padding rows. Each case is one small
launch (about a second in the interpreter).

Every cache slot outside a request's context is NaN (``make_batch``), so a read outside it
shows. Tolerance 2e-6: fp32 kernel vs float64 oracle, summation order only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv
from kvflow.kernels.paged_attention import paged_attention
from tests.kernels.paged_batch import attention_f64, make_batch

TOL = 2e-6
# (cached prefix, query tokens): a fresh prefill, decodes, chunks after a prefix that ends
# inside a block, a request with no query tokens
MIXED = [(0, 5), (33, 1), (10, 20), (0, 1), (47, 17), (15, 1), (20, 0)]
DECODES = [(300, 1), (5, 1), (64, 1)]


def _check(batch, ref_batch=None, **kwargs):
    n = int(batch["query_start_loc"][-1])
    out = paged_attention(**batch, **kwargs)
    ref = attention_f64(ref_batch or batch, sliding_window=kwargs.get("sliding_window"),
                        softcap=kwargs.get("softcap", 0.0))
    assert not out[:n].isnan().any()
    assert (out[:n].double() - ref[:n]).abs().max().item() < TOL


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [96, 112, 256])
def test_head_dims_with_mqa_group_of_eight(head_dim, num_splits):
    reqs = DECODES if num_splits > 1 else MIXED
    _check(make_batch(reqs, 8, 1, head_dim, seed=head_dim), num_splits=num_splits)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(5, 1), (7, 1), (16, 2)])
def test_gqa_groups_of_5_7_and_8(num_heads, num_kv_heads):
    _check(make_batch(MIXED, num_heads, num_kv_heads, 64, seed=num_heads))


@pytest.mark.parametrize("block_size", [1, 5, 13])
def test_odd_block_sizes(block_size):
    _check(make_batch(MIXED, 6, 2, 64, block_size=block_size, seed=block_size))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 16])
def test_window_of_one_and_of_a_block_under_chunked_prefill(window, num_splits):
    reqs = MIXED + [(100, 40)] if num_splits == 1 else DECODES
    _check(make_batch(reqs, 6, 2, 64, seed=window), sliding_window=window,
           num_splits=num_splits)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_window_split_odd_blocks(cache_dtype):
    batch = make_batch(DECODES + [(40, 1)], 8, 1, 128, block_size=13, seed=7)
    cache = batch["kv_cache"]
    qcache, scales = quantize_kv(cache.nan_to_num(0.0), cache_dtype)
    # the oracle reads the values the kernel reads (NaN where no context token is)
    deq = torch.where(cache.isnan(), cache, dequantize_kv(qcache, scales, torch.float32))
    _check({**batch, "kv_cache": qcache}, {**batch, "kv_cache": deq}, kv_scales=scales,
           num_splits=4, sliding_window=50)


def test_batch_invariant_plan_with_window_and_softcap():
    _check(make_batch(MIXED, 6, 2, 112, seed=11), batch_invariant=True, sliding_window=9,
           softcap=4.0)


def test_empty_requests_between_real_ones_and_padding_rows():
    # no query tokens and no context, no query tokens after a context, then real requests
    _check(make_batch([(0, 0), (5, 0), (0, 3), (0, 0), (17, 1)], 4, 2, 64, extra_tokens=4,
                      seed=12))
