"""The fused residual-add + RMSNorm kernel (the CUDA path of ``RMSNorm(x, residual)``) against
the unfused composition it replaces (the residual add rounded to the input dtype, then the
Triton ``rms_norm``; bit for bit) and against HF transformers' ``LlamaRMSNorm`` applied to
the sum (an independent oracle), in fp32 and bf16, at the Llama-3.1-8B hidden size (4096) and
odd ones, in the Triton interpreter on CPU (bf16 bit-exactness only on a GPU: the
interpreter's bf16 casts round differently); plus the layer's CUDA dispatch (one fused call,
the layer's in-place contract)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.norm import fused_add_rms_norm, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2,
                                                                     "rtol": 1.6e-2}}


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    residual = torch.randn(tokens, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    return (t.to(DEVICE, dtype) for t in (x, residual, weight))


def _hf_norm(hidden: int, weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden, eps=eps).to(DEVICE, weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(2, 4096), (3, 1000), (1, 97)])
def test_fused_add_rms_norm_matches_composition_and_hf(dtype, tokens, hidden):
    x, residual, weight = _inputs(tokens, hidden, dtype, seed=hidden)
    eps = 1e-5
    summed = (x.float() + residual.float()).to(dtype)  # the unfused add, as torch rounds it
    unfused = rms_norm(summed, weight, eps)
    with torch.no_grad():
        oracle = _hf_norm(hidden, weight, eps)(x + residual)
    out, new_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, eps)
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(new_residual, summed)
        assert torch.equal(out, unfused)
    else:  # the interpreter's fp32 -> bf16 casts do not round like torch's: one ulp apart
        torch.testing.assert_close(new_residual, summed, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(out, unfused, **TOL[dtype])
    torch.testing.assert_close(out, oracle, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_fused_add_rms_norm_bf16_many_tokens():
    """On a GPU, bf16 too is bit-exact against the composition (benchmarks/gpu_check.sh)."""
    test_fused_add_rms_norm_matches_composition_and_hf(torch.bfloat16, 1024, 4096)


def test_rms_norm_layer_cuda_path_is_one_fused_call(monkeypatch):
    """``RMSNorm.forward_cuda(x, residual)``: one fused_add_rms_norm call, in place (vLLM's
    convention: the returned tensors are x and residual, updated), equal to forward_native."""
    from kvflow.kernels import norm as norm_kernels
    from kvflow.layers.norm import RMSNorm

    calls = []
    original = norm_kernels.fused_add_rms_norm
    monkeypatch.setattr(norm_kernels, "fused_add_rms_norm",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    x, residual, weight = _inputs(3, 4096, torch.float32, seed=1)
    layer = RMSNorm(4096, eps=1e-5).to(DEVICE)
    layer.weight.data.copy_(weight)
    want_out, want_residual = layer.forward_native(x, residual)
    out, new_residual = layer.forward_cuda(x, residual)
    assert calls == [1] and out is x and new_residual is residual
    torch.testing.assert_close(out, want_out, **TOL[torch.float32])
    assert torch.equal(new_residual, want_residual)
