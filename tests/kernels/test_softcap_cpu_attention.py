"""Soft-capped attention scores (Gemma 2's ``attn_logit_softcapping``: ``s = cap * tanh(s /
cap)`` before the mask and softmax) in the native CPU kernels (kernels/csrc/cpu_attention.c,
cpu_attention_kvq.c; every path: row-by-row and register-tiled / bf16-dot prefill, generic,
vector and bf16 decode) vs the plain-torch per-request reference with the same cap.

Scores are made large (``scale`` 1, unit-normal q and K of head_dim 64: |q.k| ~ 8) and the cap
small (2), so the cap moves the result by O(1) (checked: a kernel that ignored it would fail).
Tolerances as tests/kernels/test_cpu_attention.py: fp32 1e-5 (tanhf vs torch.tanh differ by an
ulp or two); bf16 one unit in the last place. The cap itself (AVX2 / AVX-512 builds: the
vectorized tanh_fast of csrc/cpu_common.h; the portable build: libm tanhf) is also checked
alone, at every ISA level, against float64 ``torch.tanh``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvflow.kernels import cpu_build
from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.cpu_attention_kvq import paged_attention_kvq
from kvflow.kernels.cpu_native import native_cpu_kernels, native_cpu_kernels_for_isa
from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv
from tests.kernels.paged_batch import make_batch

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 2**-7, "rtol": 2**-7},
       torch.float16: {"atol": 2**-10, "rtol": 2**-10}}
# (cached prefix, query length): decodes, whole prompts, chunks after a cached prefix
MIXED = [(0, 1), (17, 1), (0, 37), (20, 5), (63, 40), (100, 1), (3, 16)]
CAP = 2.0


def _batch(dtype=torch.float32, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype)
    batch["scale"] = 1.0
    return batch


def _capped_ref(batch, sliding_window=None):
    """(reference with the cap, reference without) over the real rows."""
    n = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**batch, sliding_window=sliding_window, softcap=CAP)
    plain = paged_attention_ref(**batch, sliding_window=sliding_window)
    assert (ref[:n].float() - plain[:n].float()).abs().max() > 0.1  # the cap matters here
    return ref[:n], n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flags", [{}, {"tiled": False}, {"batch_invariant": True}],
                         ids=["default", "rows", "batch_invariant"])
@pytest.mark.parametrize("window", [None, 9])
def test_native_kernel_soft_caps_like_the_reference(dtype, flags, window):
    batch = _batch(dtype)
    ref, n = _capped_ref(batch, window)
    out = KERNELS.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], batch["scale"],
                                  window, softcap=CAP, **flags)
    torch.testing.assert_close(out[:n], ref.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("level", [lv.name for lv in cpu_build.isa_levels_for_cpu()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_path_caps_at_every_level(level, dtype):
    """Every kernel path caps, at every ISA level this CPU runs: the vector decode path (bf16:
    the bf16 decode path where the build has it), the register-tiled prefill path and, for a
    bf16 cache in the avx512_bf16 build, the bf16 dot-product tiles (bf16_dot) and without
    them; with a sliding window, so masking follows the cap."""
    kernels = native_cpu_kernels_for_isa(level)
    if kernels is None:
        pytest.skip(f"{level} kernels could not be built")
    batch = _batch(dtype)
    ref, n = _capped_ref(batch, 9)
    for bf16_dot in (True, False):
        out = kernels.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                      batch["seq_lens"], batch["block_table"], 1.0, 9,
                                      bf16_dot=bf16_dot, softcap=CAP)
        torch.testing.assert_close(out[:n], ref.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("head_dim, block_size", [(20, 3), (128, 32)])
def test_odd_head_dims_and_block_sizes(head_dim, block_size):
    batch = _batch(num_heads=4, num_kv_heads=4, head_dim=head_dim, block_size=block_size)
    ref, n = _capped_ref(batch)
    out = KERNELS.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], 1.0, softcap=CAP)
    torch.testing.assert_close(out[:n], ref, **TOL[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_kernel_soft_caps(cache_dtype):
    batch = _batch()
    q_cache, scales = quantize_kv(batch["kv_cache"], cache_dtype)
    ref_batch = dict(batch, kv_cache=dequantize_kv(q_cache, scales, torch.float32))
    ref, n = _capped_ref(ref_batch, 9)
    out = paged_attention_kvq(KERNELS, batch["q"], q_cache, scales, batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], 1.0, 9, softcap=CAP)
    torch.testing.assert_close(out[:n], ref, **TOL[torch.float32])


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_softcap_raises(bad):
    batch = _batch()
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        KERNELS.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                batch["seq_lens"], batch["block_table"], 1.0, softcap=bad)


@pytest.mark.parametrize("cap", [1.0, 2.0, 50.0])
def test_soft_cap_is_float64_tanh_within_its_error_bound(kernels, cap):
    """``kvflow_soft_cap`` (the attention kernels' soft_cap_scores) at each ISA level vs float64
    ``cap * tanh(s / cap)`` of the same fp32 scores, over [-20 cap, 20 cap] and tiny values.
    Bound: tanh_fast's relative error under 8 fp32 units (2^-24; exp_nonpos's ~2.6e-7 amplified
    at most 1.13x, plus 3 roundings; measured 4.4; libm's tanhf is within 2), plus the
    rounding of s / cap (which tanh does not amplify: |y tanh'(y) / tanh(y)| <= 1) and of the
    product: 10 units relative. (1 - e) / (1 + e) without the small-|y| series (1 - e
    cancelling) fails it by orders of magnitude."""
    fn = kernels.lib.kvflow_soft_cap
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    y = torch.linspace(-20, 20, 200_003, dtype=torch.float64)
    tiny = torch.logspace(-30, 0, 2_001, dtype=torch.float64)
    s = (torch.cat([y, tiny, -tiny, torch.tensor([0.0, 1e4, -1e4])]) * cap).float()
    want = cap * torch.tanh(s.double() / cap)
    got = s.clone()
    assert fn(got.data_ptr(), got.numel(), cap) == 0
    rel = (got.double() - want).abs() / want.abs().clamp_min(1e-300)
    assert float(rel.max()) <= 10 * 2.0**-24, float(rel.max()) / 2.0**-24
    assert bool((torch.signbit(got) == torch.signbit(s)).all())
    assert got[-2:].tolist() == [cap, -cap]  # saturated at exactly +-cap
