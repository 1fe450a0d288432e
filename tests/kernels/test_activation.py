"""silu_and_mul vs torch reference.  fp32: atol=rtol=1e-5; bf16 (GPU): atol=rtol=1.6e-2."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.activation import silu_and_mul, silu_and_mul_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 2 * 1500), (1, 2)])
def test_silu_and_mul(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 4
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)


def test_silu_and_mul_out_and_errors():
    x = torch.randn(4, 64, device=DEVICE)
    out = torch.empty(4, 32, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_silu_and_mul_bf16():
    x = torch.randn(2048, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 4
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=1.6e-2, rtol=1.6e-2)
