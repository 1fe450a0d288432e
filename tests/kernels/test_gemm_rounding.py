"""kvflow's C GEMM writing 16-bit outputs itself (``out_dtype`` of
:meth:`NativeCpuKernels.gemm`): each fp32 sum rounded once to nearest even inside the kernel.

Oracle: torch's own rounding (``.to(dtype)``) of the same kernel's fp32 result, which must
match bit for bit (the sums are the same, in the same k order; only where the rounding happens
moves), at every ISA level this CPU runs and through the work-sharing pool; NaN and infinities
pass through as torch rounds them."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cpu_build
from kvflow.kernels.cpu_native import native_cpu_kernels_for_isa
from kvflow.kernels.cpu_pool import CpuPool
from kvflow.kernels.gemm import NativePackedWeight, linear

LEVELS = [lv.name for lv in cpu_build.isa_levels_for_cpu()]
SHAPES = [(1, 33, 64), (7, 70, 96), (97, 48, 600), (200, 100, 1536)]


def _operands(kernels, m, n, k, wdt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(kernels.gemm_x_dtype(wdt))
    w = torch.randn(n, k, generator=gen).to(wdt)
    return x, kernels.gemm_pack(w), torch.randn(n, generator=gen)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_output_is_the_fp32_result_rounded_once(level, wdt, out_dtype):
    kernels = native_cpu_kernels_for_isa(level)
    if kernels is None:
        pytest.skip(f"{level} kernels could not be built")
    for i, (m, n, k) in enumerate(SHAPES):
        x, packed, b = _operands(kernels, m, n, k, wdt, seed=i)
        for bias in (None, b):
            wide = kernels.gemm(x, packed, n, bias)
            got = kernels.gemm(x, packed, n, bias, out_dtype)
            assert got.dtype == out_dtype and got.shape == (m, n)
            assert torch.equal(got.view(torch.int16), wide.to(out_dtype).view(torch.int16))


def test_special_values_round_as_torch_does():
    """Rows of x holding NaN, +-inf and values beyond fp16's range (bias 0)."""
    kernels = native_cpu_kernels_for_isa(LEVELS[0])
    if kernels is None:
        pytest.skip("native kernels could not be built")
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = float("nan"), float("inf"), -float("inf"), 7e4
    w = torch.ones(40, 32)
    packed = kernels.gemm_pack(w)
    for out_dtype in (torch.bfloat16, torch.float16):
        got = kernels.gemm(x, packed, 40, None, out_dtype)
        want = kernels.gemm(x, packed, 40).to(out_dtype)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_pool_and_linear_write_the_same_16_bit_output():
    kernels = native_cpu_kernels_for_isa(LEVELS[0])
    if kernels is None:
        pytest.skip("native kernels could not be built")
    x, packed, b = _operands(kernels, 200, 100, 1536, torch.bfloat16, seed=9)
    x = x.bfloat16().to(x.dtype)  # fp32 where the CPU has no bf16 dot products (AVX2)
    want = kernels.gemm(x, packed, 100, b).to(torch.bfloat16)
    pool = CpuPool(kernels, 1)
    try:
        assert torch.equal(pool.gemm(x, packed, 100, b, torch.bfloat16), want)
    finally:
        pool.close()
    weight = NativePackedWeight.__new__(NativePackedWeight)
    weight.kernels, weight.out_features, weight.packed = kernels, 100, packed
    got = linear(x.bfloat16(), torch.empty(0, 1536), b, packed=weight)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.gemm(x, packed, 100, b, torch.float64)
