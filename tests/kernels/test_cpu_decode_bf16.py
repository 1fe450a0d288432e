"""The bf16 decode path of the native CPU attention (kernels/csrc/cpu_attention_decode_bf16.h:
even/odd bf16 halves widened in place, streamed prefetch) vs a float64 oracle.

The oracle computes softmax(q k^T scale) v in float64 from the same bf16 values. The bound is
the kernel's arithmetic: fp32 products of bf16 values are exact; a score's fp32 sum over D
terms errs by <= D 2^-24 sum_i |q_i k_i| scale (plus the scaling's 2^-24), which moves a softmax
weight by a relative 2x that; the exp polynomial adds 2e-7, the weight sum and each output sum
over n keys n 2^-24; so before rounding |out - ref| <= (2 e_score + 2e-7 + 2 n 2^-24) max|v|,
and the final rounding to bf16 adds half a unit in the last place, <= 2^-8 |ref|. The test
allows twice that. Shapes cover 1-4 32-dim chunks (head_dim 32-128), GQA groups of 1, 3, 4 and
5 (four heads, then one), contexts with 0-3 keys past a multiple of four, block sizes 1, 3, 16
and 32, and sliding windows.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from tests.kernels.paged_batch import make_batch

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")
EPS32 = 2.0**-24


def oracle_and_bound(batch, window):
    """float64 decode attention of every request's one query token, and the per-element bound
    on the kernel's error (see the module docstring)."""
    q, cache = batch["q"].double(), batch["kv_cache"].double()
    _, _, bs, hkv, d = cache.shape
    group = q.shape[1] // hkv
    refs, bounds = [], []
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        lo = max(0, seq_len - window) if window else 0
        pos = torch.arange(lo, seq_len)
        blocks = batch["block_table"][i, pos // bs].long()
        k = cache[0, blocks, pos % bs].repeat_interleave(group, 1)  # [n, H, D]
        v = cache[1, blocks, pos % bs].repeat_interleave(group, 1)
        qi = q[i]  # [H, D]
        scores = torch.einsum("hd,nhd->hn", qi, k) * batch["scale"]
        ref = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)
        abs_dot = torch.einsum("hd,nhd->hn", qi.abs(), k.abs()) * batch["scale"]
        e_score = (d + 1) * EPS32 * abs_dot.amax(-1, keepdim=True)  # [H, 1]
        n = len(pos)
        vmax = v.abs().amax(0)  # [H, D]
        fp32 = (2 * e_score + 2e-7 + 2 * (n + 1) * EPS32) * vmax
        refs.append(ref)
        bounds.append(2 * (fp32 + 2.0**-8 * ref.abs()))
    return torch.stack(refs), torch.stack(bounds)


def run(reqs, num_heads, num_kv_heads, head_dim, block_size=16, window=None, seed=0):
    batch = make_batch([(n - 1, 1) for n in reqs], num_heads, num_kv_heads, head_dim,
                       block_size=block_size, dtype=torch.bfloat16, seed=seed)
    out = KERNELS.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], batch["scale"],
                                  window)
    ref, bound = oracle_and_bound(batch, window)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max())}, at {err.argmax()}"
    return out, ref


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (4, 1), (10, 2)])
def test_decode_bf16_within_arithmetic_bound(head_dim, num_heads, num_kv_heads):
    run([1, 2, 3, 4, 5, 16, 17, 63, 130, 257], num_heads, num_kv_heads, head_dim, seed=head_dim)


@pytest.mark.parametrize("block_size", [1, 3, 32])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_decode_bf16_blocks_and_windows(block_size, window):
    run([1, 6, 33, 70, 101], 6, 2, 64, block_size=block_size, window=window, seed=block_size)


def test_decode_bf16_is_not_the_fp32_of_an_element_swap():
    """The even/odd split is undone: neighbouring dims of the random cache differ by O(1), so an
    output with each dim pair swapped would miss the oracle by far more than the kernel does."""
    out, ref = run([40, 41], 3, 1, 64, seed=5)
    swapped = ref.view(*ref.shape[:-1], -1, 2).flip(-1).reshape(ref.shape)
    assert (out.double() - ref).abs().max() < (swapped - ref).abs().max() / 4
