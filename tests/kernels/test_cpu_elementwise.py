"""Native CPU fused ops (kernels/csrc/cpu_elementwise.c) vs plain torch, RMSNorm, SiLU-and-mul
and rotary at every ISA level this CPU runs (the ``kernels`` fixture: the AVX512 builds take
the 16-lane rows of cpu_elementwise_avx512.h, AVX2 and the baseline the portable loops).

Oracles: float64 math for fp32 inputs (atol=rtol=1e-5); for bf16/fp16 the torch code the kernel
replaces, computed in fp32 and rounded where torch rounds, within one unit in the last place of
the dtype (the kernels' exp polynomial and summation order differ from torch's in the last fp32
bits, which can flip a 16-bit rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.layers.rotary import RotaryEmbedding

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref.double(), atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=ULP[dtype], rtol=ULP[dtype])


def rms_norm_ref(x, weight, eps):
    if x.dtype == torch.float32:
        xd = x.double()
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed * weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8, 33, 576, 1001])  # 33: two 16-lane steps and a tail of 1
def test_rms_norm(kernels, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    assert_close(kernels.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_leaves_inputs_untouched(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(19, 200, generator=gen).to(dtype)
    x = wide[:, :96]  # strided rows
    residual = torch.randn(19, 96, generator=gen).to(dtype)
    weight = torch.rand(96, generator=gen).to(dtype)
    x_before, r_before = x.clone(), residual.clone()
    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
    expect_residual = x + residual  # torch adds in fp32 and rounds once, as the kernel does
    assert torch.equal(new_residual, expect_residual)
    assert_close(out, rms_norm_ref(expect_residual, weight, 1e-6), dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_add_rounds_ties_to_even_and_keeps_nan_inf(kernels, dtype):
    """x + residual lands exactly halfway between two 16-bit values (both directions of the
    tie-to-even rule), overflows, or is NaN: the stored residual has torch's bits."""
    ulp = ULP[dtype]  # spacing of the dtype in [1, 2)
    x = torch.ones(3, 40)
    residual = torch.empty(3, 40)
    residual[:, 0::2] = ulp / 2  # 1 + ulp/2: tie -> 1 (even)
    residual[:, 1::2] = 3 * ulp / 2  # 1 + 3ulp/2: tie -> 1 + 2ulp (even)
    x[0, 3], x[1, 7], x[2, 11] = float("nan"), float("inf"), -float("inf")
    x[2, 12] = torch.finfo(dtype).max
    residual[2, 12] = torch.finfo(dtype).max  # overflows to inf
    x, residual = x.to(dtype), residual.to(dtype)
    _, new_residual = kernels.rms_norm(x, torch.ones(40, dtype=dtype), 1e-6, residual)
    expect = x + residual
    same = (new_residual == expect) | (new_residual.isnan() & expect.isnan())
    assert bool(same.all()), (new_residual[~same], expect[~same])
    assert float(new_residual[0, 0]) == 1.0 and float(new_residual[0, 1]) == 1 + 2 * ulp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 17, 24, 1536])
def test_silu_and_mul(kernels, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(29, 2 * inter, generator=gen) * 6).to(dtype)  # exp of both signs, large |v|
    gate, up = x.chunk(2, dim=-1)
    out = kernels.silu_and_mul(x)
    if dtype == torch.float32:
        assert_close(out, F.silu(gate.double()) * up.double(), dtype)
        return
    ref = F.silu(gate.float()).to(dtype) * up
    # silu is rounded to the dtype before the product (as torch does). Where the exact silu lies
    # within a relative 1e-6 (the kernel's and torch's fp32 errors: exp polynomial 2e-7, the
    # division, a few roundings) of a rounding midpoint of the dtype, the two can round it to
    # neighbours: the product then moves by one unit of silu's last place times |up|.
    exact = F.silu(gate.double())
    mant = 8 if dtype == torch.bfloat16 else 11
    ulp_s = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - (mant - 1))
    to_mid = ((exact / ulp_s) - (exact / ulp_s).floor() - 0.5).abs() * ulp_s
    near_mid = to_mid <= 1e-6 * exact.abs()
    bound = ULP[dtype] * (1 + ref.double().abs()) + near_mid * ulp_s * up.double().abs()
    err = (out.double() - ref.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert int(near_mid.sum()) <= max(2, exact.numel() // 100)  # it covers few elements


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,is_neox,rotary_dim", [
    (32, True, 32), (32, False, 32), (32, True, 16), (32, False, 16),  # partial: 16 of 32
    (80, True, 80), (80, False, 40), (128, True, 64)])  # 80: 16-lane halves of 40 = 32 + 8
def test_rotary_in_place(kernels, dtype, head_dim, is_neox, rotary_dim):
    rope = RotaryEmbedding(head_dim, 512, 10000.0, rotary_dim=rotary_dim, is_neox_style=is_neox)
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(11, (6 + 2 * 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :6 * head_dim].view(11, 6, head_dim)
    k = qkv[:, 6 * head_dim:8 * head_dim].view(11, 2, head_dim)
    positions = torch.randint(0, 512, (11,), generator=gen)
    v_before = qkv[:, 8 * head_dim:].clone()
    cos, sin = rope.cos_sin_cache.double()[positions].unsqueeze(1).chunk(2, dim=-1)
    ref_q = rope._rotate(q.double(), cos, sin)
    ref_k = rope._rotate(k.double(), cos, sin)
    out_q, out_k = kernels.rotary(positions, q, k, rope.cos_sin_cache, is_neox)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert_close(q, ref_q.to(dtype), dtype)
    assert_close(k, ref_k.to(dtype), dtype)
    assert torch.equal(qkv[:, 8 * head_dim:], v_before)  # the rest of the qkv row is untouched


def test_bad_arguments_raise_value_error():
    x = torch.randn(4, 16)
    w = torch.ones(16)
    cache = RotaryEmbedding(16, 8, 10000.0).cos_sin_cache
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    calls = [
        lambda: KERNELS.rms_norm(x.double(), w.double(), 1e-6),      # dtype
        lambda: KERNELS.rms_norm(x, w.bfloat16(), 1e-6),             # weight dtype
        lambda: KERNELS.rms_norm(x, torch.ones(8), 1e-6),            # weight shape
        lambda: KERNELS.rms_norm(x, w, 1e-6, torch.randn(3, 16)),    # residual shape
        lambda: KERNELS.rms_norm(x.t(), torch.ones(4), 1e-6),        # column-major rows
        lambda: KERNELS.silu_and_mul(torch.randn(4, 7)),             # odd width
        lambda: KERNELS.rotary(torch.tensor([0, 1, 8]), q, k, cache, True),   # position >= 8
        lambda: KERNELS.rotary(torch.tensor([0, 1, 2]), q, k.bfloat16(), cache, True),
        lambda: KERNELS.rotary(torch.tensor([0, 1, 2]), q, k, cache.double(), True),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_equal_f_embedding(dtype):
    """Any order, repeats, first and last rows, a table with padded rows (row stride > width):
    bit for bit what F.embedding returns."""
    torch.manual_seed(0)
    table = torch.randn(50, 40).to(dtype)[:, :24]  # row stride 40, width 24
    ids = torch.tensor([49, 0, 7, 7, 31, 2], dtype=torch.int64)
    out = KERNELS.embedding(table, ids)
    assert out.is_contiguous() and torch.equal(out, F.embedding(ids, table))
    assert KERNELS.embedding(table, ids[:0]).shape == (0, 24)


def test_embedding_refuses_ids_outside_the_table():
    table = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        KERNELS.embedding(table, torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        KERNELS.embedding(table, torch.tensor([-1]))
    with pytest.raises(ValueError, match="int64"):
        KERNELS.embedding(table, torch.tensor([1], dtype=torch.int32))
