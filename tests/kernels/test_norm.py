"""RMSNorm kernels vs torch references.

fp32 (CPU interpreter): atol=rtol=1e-5.  bf16 (GPU): atol=rtol=1.6e-2 (one bf16 ulp of the
normalised value; the reduction order differs from torch's).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CPU_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 1.6e-2, "rtol": 1.6e-2}


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    res = torch.randn(*shape, generator=gen)
    w = torch.rand(shape[-1], generator=gen) + 0.5
    return (t.to(device=DEVICE, dtype=dtype) for t in (x, res, w))


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96), (2, 1000)])
def test_rms_norm(shape):
    x, _, w = _inputs(shape, torch.float32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **CPU_TOL)


def test_rms_norm_in_place_out():
    x, _, w = _inputs((4, 64), torch.float32, seed=1)
    expected = rms_norm_ref(x, w, 1e-5)
    assert rms_norm(x, w, 1e-5, out=x) is x
    torch.testing.assert_close(x, expected, **CPU_TOL)


@pytest.mark.parametrize("inplace", [True, False])
def test_fused_add_rms_norm(inplace):
    x, res, w = _inputs((9, 160), torch.float32, seed=2)
    x0, res0 = x.clone(), res.clone()
    exp_out, exp_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6, inplace=inplace)
    torch.testing.assert_close(out, exp_out, **CPU_TOL)
    torch.testing.assert_close(new_res, exp_res, **CPU_TOL)
    if inplace:
        assert out is x and new_res is res
    else:
        assert torch.equal(x, x0) and torch.equal(res, res0)


def test_bad_weight_shape():
    x, _, w = _inputs((2, 64), torch.float32)
    with pytest.raises(ValueError):
        rms_norm(x, w[:10], 1e-6)


def test_out_with_fewer_rows_than_x_is_refused():
    """The kernel writes one row of ``out`` per row of ``x``: a smaller ``out`` (here a view
    of the first 2 rows of a buffer) would have rows written past its end."""
    x, _, w = _inputs((4, 64), torch.float32)
    buffer = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=buffer[:2])
    assert not buffer.any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_gpu_norms_bf16(hidden):
    x, res, w = _inputs((1024, hidden), torch.bfloat16, seed=3)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **BF16_TOL)
    exp_out, exp_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, exp_res, atol=0, rtol=0)
    torch.testing.assert_close(out, exp_out, **BF16_TOL)
