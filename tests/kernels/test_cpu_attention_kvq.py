"""The native CPU paged-attention kernel for an int8 / float8-e4m3 KV cache
(kernels/csrc/cpu_attention_kvq.c) vs the plain-torch reference run over the dequantized cache
(``q * scale`` per row, kernels/kv_quant.py).

Tolerances as tests/kernels/test_cpu_attention.py: fp32 atol=rtol=1e-5 (the kernel multiplies
the row scale after the dot product, the reference before: one extra fp32 rounding per term);
bf16/fp16 one unit in the last place of the storage dtype. Unused cache slots have NaN scales,
so a read outside a request's context poisons the output.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.cpu_attention_kvq import paged_attention_kvq
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv
from tests.kernels.paged_batch import make_batch

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 2**-7, "rtol": 2**-7},
       torch.float16: {"atol": 2**-10, "rtol": 2**-10}}
MIXED = [(0, 1), (17, 1), (0, 37), (20, 5), (0, 1), (63, 40), (100, 1), (3, 16)]
CACHE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def check(batch, cache_dtype, sliding_window=None):
    q_cache, scales = quantize_kv(batch["kv_cache"].float(), cache_dtype)  # NaN rows: NaN scale
    ref_batch = dict(batch, kv_cache=dequantize_kv(q_cache, scales, torch.float32))
    ref_batch["q"] = batch["q"].float()
    n_real = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**ref_batch, sliding_window=sliding_window)
    out = paged_attention_kvq(KERNELS, batch["q"], q_cache, scales, batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], batch["scale"],
                              sliding_window)
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    dtype = batch["q"].dtype
    torch.testing.assert_close(out[:n_real], ref[:n_real].to(dtype), **TOL[dtype])


@pytest.mark.parametrize("cache", list(CACHE))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64),
                                                               (8, 1, 128), (6, 2, 20)])
def test_mixed_batch_matches_reference(cache, num_heads, num_kv_heads, head_dim):
    check(make_batch(MIXED, num_heads, num_kv_heads, head_dim), CACHE[cache])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_queries(dtype):
    check(make_batch(MIXED, 4, 2, 32, dtype=dtype, seed=2), torch.int8)


@pytest.mark.parametrize("window", [1, 5, 33])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window_and_block_sizes(window, block_size):
    check(make_batch(MIXED, 4, 2, 32, block_size=block_size, seed=1), torch.float8_e4m3fn,
          sliding_window=window)


def test_the_scales_are_read():
    """Doubling every scale doubles every value: the output (a convex mix of values whose
    scores also change) differs from the reference at the original scales."""
    batch = make_batch([(5, 3)], 2, 1, 16, seed=3)
    q_cache, scales = quantize_kv(batch["kv_cache"], torch.int8)
    args = (batch["query_start_loc"], batch["seq_lens"], batch["block_table"], batch["scale"])
    base = paged_attention_kvq(KERNELS, batch["q"], q_cache, scales, *args)
    scaled = paged_attention_kvq(KERNELS, batch["q"], q_cache, scales * 2, *args)
    ref = paged_attention_ref(**dict(batch, kv_cache=dequantize_kv(q_cache, scales * 2,
                                                                   torch.float32)))
    torch.testing.assert_close(scaled, ref, atol=1e-5, rtol=1e-5)
    assert (scaled - base).abs().max() > 0.1


def test_rejects_a_float_cache():
    batch = make_batch([(0, 2)], 2, 2, 16)
    with pytest.raises(ValueError, match="int8/float8_e4m3fn cache"):
        paged_attention_kvq(KERNELS, batch["q"], batch["kv_cache"],
                            torch.ones(batch["kv_cache"].shape[:4]), batch["query_start_loc"],
                            batch["seq_lens"], batch["block_table"], batch["scale"])
