"""kvflow's C GEMM on AMX tiles (``kernels/csrc/cpu_gemm_amx.h``, the ``amx_bf16`` build):
bf16 weights times bf16 activations, accumulated in fp32 by TDPBF16PS, 16 x 16 output tiles,
32 values of k per step, where k is a multiple of 32.

Oracle: the float64 product of the same operands (bf16 widened exactly); the fp32 result must
lie within the worst-case fp32 summation error (``fp32_error_bound``, from the arithmetic:
each of the K products is exact in fp32 and each addition rounds once). Shapes cover the
tiles' edges: rows below, at and across 16 and 32 (one or two row tiles per pass) and across
x blocks, an edge panel (fewer than 32 columns), one and many k steps, bias or none."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels_for_isa
from tests.kernels.test_gemm import _fp32_oracle_check

AMX = native_cpu_kernels_for_isa("amx_bf16")
pytestmark = pytest.mark.skipif(AMX is None or not AMX.lib.kvflow_gemm_amx(32),
                                reason="no AMX-BF16 on this CPU (or not granted)")


@pytest.mark.parametrize("m,n,k", [(1, 33, 32), (16, 32, 64), (17, 70, 96), (45, 64, 576),
                                   (200, 70, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_gemm_matches_float64_oracle(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    got = AMX.gemm(x, AMX.gemm_pack(w), n, b)
    _fp32_oracle_check(got, x.float(), w.float(), b)


def test_amx_reads_strided_rows_and_matches_the_dot_product_build():
    """x read in place at its row stride; the AVX512-BF16 build (VDPBF16PS, another summation
    order) gives the same values within the bound, and the AMX build takes tiles only for k a
    multiple of 32."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(40, 200, generator=gen).bfloat16()
    x, w = wide[:, 8:168], torch.randn(50, 160, generator=gen).bfloat16()
    got = AMX.gemm(x, AMX.gemm_pack(w), 50)
    _fp32_oracle_check(got, x.float(), w.float(), None)
    dot = native_cpu_kernels_for_isa("avx512_bf16")
    if dot is not None:
        _fp32_oracle_check(dot.gemm(x, dot.gemm_pack(w), 50), x.float(), w.float(), None)
        assert not dot.lib.kvflow_gemm_amx(160)
    assert [AMX.lib.kvflow_gemm_amx(k) for k in (32, 160, 600, 0)] == [1, 1, 0, 0]


# cpu_gemm_amx.h blocks x in AMX_MB = 256 rows and walks k in AMX_KB = 256 chunks: these cover
# several row blocks (a last block of 1 and of 33 rows), k over one, two and six chunks and a
# last chunk shorter than the others.
@pytest.mark.parametrize("m,n,k", [(257, 40, 320), (289, 64, 576), (513, 33, 64),
                                   (64, 96, 1536)])
def test_amx_blocks_and_k_chunks_match_float64_oracle(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    got = AMX.gemm(x, AMX.gemm_pack(w), n, b)
    _fp32_oracle_check(got, x.float(), w.float(), b)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_amx_16_bit_output_is_its_fp32_result_rounded_once(out_dtype):
    """A 16-bit y is rounded per 32-row group inside the AMX kernel: bit for bit torch's
    rounding of the same kernel's fp32 result, across row blocks and an edge panel."""
    gen = torch.Generator().manual_seed(11)
    m, n, k = 300, 70, 576
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = AMX.gemm_pack(torch.randn(n, k, generator=gen).bfloat16())
    b = torch.randn(n, generator=gen)
    for bias in (None, b):
        wide = AMX.gemm(x, packed, n, bias)
        got = AMX.gemm(x, packed, n, bias, out_dtype)
        assert torch.equal(got.view(torch.int16), wide.to(out_dtype).view(torch.int16))
