"""kvflow's native weight-only INT8 GEMM (``csrc/cpu_quant_gemm.c``) against a plain torch
float64 reference, at every ISA level this CPU runs (AVX512: 16 lanes; AVX2 and the baseline:
8), on odd shapes (K not a multiple of the vector width, N not a multiple of the rows per
micro-kernel, M across the 1-4-row blocks), with fp32/bf16/fp16 activations and outputs.

Bound (from the arithmetic, not from another kernel's error): the dot product of K terms
summed in fp32 in any order, then one multiplication by the scale and one addition of the
bias, is within ``gamma_(K+2) * (s * |x| @ |q|.T + |b|)`` of the exact value, ``gamma_n =
n u / (1 - n u)``, ``u = 2^-24`` (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., section 3.1); a 16-bit output then rounds once more (relative ``2^-8`` bf16,
``2^-11`` fp16, plus fp16's subnormal spacing). 16-bit activations are widened exactly, so the
reference takes the rounded activations.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import config as kv_config
from kvflow.kernels import cpu_native
from kvflow.kernels.cpu_quant import int8_gemm
from kvflow.layers.linear import RowParallelLinear
from kvflow.quant.int8 import Int8EmbeddingMethod, Int8WeightOnlyMethod

pytestmark = pytest.mark.skipif(cpu_native.native_cpu_kernels() is None,
                                reason="native CPU kernels not built")
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}



def _case(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-4
    bias = torch.randn(n, generator=gen)
    return x, q, scale, bias


def _reference_and_bound(x, q, scale, bias, out_dtype):
    x64, q64, s64 = x.double(), q.double(), scale.double()
    b64 = torch.zeros_like(s64) if bias is None else bias.double()
    ref = (x64 @ q64.T) * s64 + b64
    n = x.shape[-1] + 2
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    bound = gamma * ((x64.abs() @ q64.abs().T) * s64 + b64.abs())
    u = UNIT[out_dtype]
    bound = bound * (1 + u) + u * ref.abs() + (2.0 ** -24 if out_dtype == torch.float16 else 0)
    return ref, bound


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 37, 53), (2, 17, 16), (3, 100, 576),
                                   (4, 9, 7), (5, 61, 200), (7, 24, 1000), (16, 33, 129),
                                   (17, 8, 40)])
def test_int8_gemm_within_fp32_bound_at_every_level(kernels, m, n, k):
    x, q, scale, bias = _case(m, n, k, seed=m * 1000 + n + k)
    assert_within_bound_per_dtype(kernels, x, q, scale, bias, _reference_and_bound)


def assert_within_bound_per_dtype(kernels, x: torch.Tensor, q: torch.Tensor,
                                  scale: torch.Tensor, bias: torch.Tensor,
                                  reference_and_bound) -> None:
    """The INT8 GEMM of ``x`` [M, K] by ``q`` [N, K] for fp32 / bf16 / fp16 activations and
    outputs, with and without ``bias``, has shape [M, N] and the output dtype, and lies within
    ``reference_and_bound(x, q, scale, bias, out_dtype)``'s float64 bound of its reference."""
    m, n = x.shape[0], q.shape[0]
    for x_dtype, out_dtype, b in ((torch.float32, torch.float32, bias),
                                  (torch.float32, torch.float32, None),
                                  (torch.bfloat16, torch.bfloat16, bias),
                                  (torch.bfloat16, torch.float32, None),
                                  (torch.float16, torch.float16, bias)):
        xs = x.to(x_dtype)
        got = int8_gemm(kernels, xs, q, scale, b, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        ref, bound = reference_and_bound(xs.float(), q, scale, b, out_dtype)
        err = (got.double() - ref).abs()
        assert bool((err <= bound).all()), (x_dtype, out_dtype, float((err / bound).max()))


def test_rows_do_not_depend_on_the_batch_or_threads():
    """Each output's summation order depends on K and the path only: a row computed with 16
    others, alone (fp32) or in pairs (bf16: one-row calls take the fp32 path there), or with
    another thread count is bitwise the same (batch invariance)."""
    assert_rows_independent(*_case(17, 150, 300, seed=7))


def assert_rows_independent(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    """The first 16 rows of ``x`` [>= 16, K] through the INT8 GEMM are bitwise the same
    computed together, one (fp32) or two (bf16) rows per call on one thread, and rows 5-8
    alone."""
    kernels = cpu_native.native_cpu_kernels()
    threads = torch.get_num_threads()
    for xs, per_call in ((x, 1), (x.bfloat16(), 2)):
        whole = int8_gemm(kernels, xs, q, scale, bias)
        try:
            torch.set_num_threads(1)
            parts = [int8_gemm(kernels, xs[i:i + per_call], q, scale, bias)
                     for i in range(0, 16, per_call)]
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(whole[:16], torch.cat(parts))
        assert torch.equal(int8_gemm(kernels, xs[5:9], q, scale, bias), whole[5:9])


def test_strided_rows_and_leading_dims():
    kernels = cpu_native.native_cpu_kernels()
    x, q, scale, _ = _case(6, 20, 48, seed=3)
    wide = torch.zeros(6, 64)
    wide[:, 8:56] = x
    strided = wide[:, 8:56]  # row stride 64
    assert torch.equal(int8_gemm(kernels, strided, q, scale),
                       int8_gemm(kernels, x.contiguous(), q, scale))
    got = int8_gemm(kernels, x.view(2, 3, 48), q, scale)
    assert got.shape == (2, 3, 20) and torch.equal(got.view(6, 20), int8_gemm(kernels, x, q,
                                                                              scale))


def test_bad_inputs_are_value_errors():
    kernels = cpu_native.native_cpu_kernels()
    x, q, scale, bias = _case(2, 8, 32, seed=0)
    with pytest.raises(ValueError, match="int8 CPU"):
        int8_gemm(kernels, x, q.float(), scale)
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        int8_gemm(kernels, x[:, :16], q, scale)
    with pytest.raises(ValueError, match="scale"):
        int8_gemm(kernels, x, q, scale.double())
    with pytest.raises(ValueError, match="bias"):
        int8_gemm(kernels, x, q, scale, bias[:4])
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        int8_gemm(kernels, x.double(), q, scale)


def _int8_layer(w: torch.Tensor) -> RowParallelLinear:
    layer = RowParallelLinear(w.shape[1], w.shape[0], bias=True)
    layer.set_quant_method(Int8WeightOnlyMethod())
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.data.normal_(generator=torch.Generator().manual_seed(2))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_native_by_default_and_torch_on_request(monkeypatch, dtype):
    """``KVFLOW_CPU_QUANT`` picks the kernel: native (default) is the float64 reference within
    the bound; ``torch`` (``_weight_int8pack_mm`` / dequantized GEMM) agrees within bf16
    rounding; another value is refused when the device config is built."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    layer = _int8_layer(w)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    monkeypatch.delenv("KVFLOW_CPU_QUANT", raising=False)
    native = layer(x)
    ref, bound = _reference_and_bound(x.float(), layer.weight, layer.weight_scale,
                                      layer.bias.float(), dtype)
    assert native.dtype == dtype and bool(((native.double() - ref).abs() <= bound).all())
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "torch")
    via_torch = layer(x)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(via_torch.float(), native.float(), atol=tol, rtol=tol)
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "fast")
    with pytest.raises(ValueError, match="KVFLOW_CPU_QUANT"):
        kv_config.DeviceConfig()


def test_lm_head_logits_native_fp32():
    """The INT8 vocabulary table's logits: fp32, unrounded, within the bound of the float64
    reference for bf16 hidden states (widened inside the kernel) at decode and batch sizes."""
    gen = torch.Generator().manual_seed(9)
    table = torch.randn(1000, 96, generator=gen)
    layer = torch.nn.Module()
    method = Int8EmbeddingMethod()
    method.create_weights(layer, 1000, 96, torch.float32)
    layer.weight.data.copy_(table)
    method.process_weights_after_loading(layer)
    for rows in (1, 5, 20):
        hidden = torch.randn(rows, 96, generator=gen).bfloat16()
        out = method.logits(layer, hidden)
        assert out.dtype == torch.float32 and out.shape == (rows, 1000)
        ref, bound = _reference_and_bound(hidden.float(), layer.weight, layer.weight_scale,
                                          None, torch.float32)
        assert bool(((out.double() - ref).abs() <= bound).all())
