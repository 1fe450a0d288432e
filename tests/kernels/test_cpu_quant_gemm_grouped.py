"""kvflow's native INT8 GEMM with group scales (``kvflow_int8_gemm_grouped``: GPTQ 8-bit and
compressed-tensors W8A16 group layouts) against a plain torch float64 reference on the
dequantized weight ``q * scale`` (each scale repeated over its G columns), at every ISA level
this CPU runs (AVX512: 16 lanes; AVX2 and the baseline: 8), for group sizes 32/64/128 and
groups that are not a multiple of the vector width (K not one either), M across the micro-kernel
row blocks, fp32/bf16/fp16 activations and outputs.

Bound (from the arithmetic): every product ``x * q`` passes through at most one product
rounding, G - 1 additions inside its group (lanes, the 16-lane tree, or the scalar tail), the
multiplication by its scale and the addition into the group sums (two roundings without FMA),
K/G - 1 additions across groups, the lane tree's 4 levels, the tails' join and the bias: fewer
than ``n = G + K/G + 8`` roundings, so the error is within ``gamma_n * (|x| @ (|q| s).T +
|b|)``, ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., section 3.1); a 16-bit output rounds once more (``2^-8``
bf16, ``2^-11`` fp16, plus fp16's subnormal spacing). 16-bit activations widen exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvflow.kernels import cpu_native
from kvflow.kernels.cpu_quant import int8_gemm
from kvflow.quant import pack_quantized
from kvflow.quant.pack_quantized import PackedInt8Method
from tests.kernels.test_cpu_quant_gemm import (
    assert_rows_independent,
    assert_within_bound_per_dtype,
)

pytestmark = pytest.mark.skipif(cpu_native.native_cpu_kernels() is None,
                                reason="native CPU kernels not built")
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}



def _case(m: int, n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    # scales spread over two decades, so a group scale applied to the wrong group shows
    scale = torch.rand(n, k // group, generator=gen) * 0.02 * 10 ** torch.rand(
        n, k // group, generator=gen) + 1e-4
    bias = torch.randn(n, generator=gen)
    return x, q, scale, bias


def _reference_and_bound(x, q, scale, bias, out_dtype):
    group = q.shape[1] // scale.shape[1]
    w64 = q.double() * scale.double().repeat_interleave(group, dim=1)
    b64 = torch.zeros(q.shape[0], dtype=torch.float64) if bias is None else bias.double()
    x64 = x.double()
    ref = x64 @ w64.T + b64
    n = group + scale.shape[1] + 8
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    bound = gamma * (x64.abs() @ w64.abs().T + b64.abs())
    u = UNIT[out_dtype]
    bound = bound * (1 + u) + u * ref.abs() + (2.0 ** -24 if out_dtype == torch.float16 else 0)
    return ref, bound


@pytest.mark.parametrize("m,n,k,group", [
    (1, 37, 128, 32), (1, 576, 576, 64), (2, 17, 256, 128), (3, 100, 384, 128),
    (4, 9, 120, 40),    # G and K not multiples of 8 or 16 lanes: scalar tails in each group
    (5, 61, 72, 24), (7, 24, 64, 64), (8, 33, 96, 32), (9, 20, 200, 8), (17, 8, 192, 64),
    (1, 5, 7, 7)])
def test_grouped_int8_gemm_within_fp32_bound_at_every_level(kernels, m, n, k, group):
    x, q, scale, bias = _case(m, n, k, group, seed=m * 1000 + n + k + group)
    assert_within_bound_per_dtype(kernels, x, q, scale, bias, _reference_and_bound)


def test_one_group_is_the_per_channel_product():
    """A scale [N, 1] (one group of all K columns) is the per-channel kernel's result within
    the bound; scales differing per group are not applied as one (a swapped pair of group
    scales moves the result past the bound)."""
    kernels = cpu_native.native_cpu_kernels()
    x, q, scale, _ = _case(3, 40, 128, 128, seed=11)
    grouped = int8_gemm(kernels, x, q, scale)
    channel = int8_gemm(kernels, x, q, scale[:, 0].contiguous())
    ref, bound = _reference_and_bound(x, q, scale, None, torch.float32)
    assert bool(((grouped.double() - ref).abs() <= bound).all())
    assert bool(((channel.double() - ref).abs() <= 2 * bound).all())
    x, q, scale, _ = _case(3, 40, 128, 64, seed=12)
    swapped = int8_gemm(kernels, x, q, scale.flip(1).contiguous())
    ref, bound = _reference_and_bound(x, q, scale, None, torch.float32)
    assert bool(((swapped.double() - ref).abs() > bound).any())


def test_grouped_rows_do_not_depend_on_the_batch_or_threads():
    """A row's summation order depends on K, G and the path only: computed with 16 others,
    alone (fp32) or in pairs (bf16), or on one thread, it is bitwise the same."""
    assert_rows_independent(*_case(17, 150, 320, 64, seed=7))


def test_bad_group_scales_are_value_errors():
    kernels = cpu_native.native_cpu_kernels()
    x, q, scale, _ = _case(2, 8, 96, 32, seed=0)
    with pytest.raises(ValueError, match=r"group scale .* K = 96"):
        int8_gemm(kernels, x, q, torch.ones(8, 5))  # 5 columns do not divide K
    with pytest.raises(ValueError, match="group scale"):
        int8_gemm(kernels, x, q, scale.double())
    with pytest.raises(ValueError, match="group scale"):
        int8_gemm(kernels, x, q, scale[:4])
    with pytest.raises(ValueError, match="group scale"):
        int8_gemm(kernels, x, q, scale.t().contiguous().t())  # not contiguous


def _grouped_layer(n: int, k: int, group: int, seed: int) -> tuple[nn.Module, PackedInt8Method]:
    _, q, scale, bias = _case(1, n, k, group, seed)
    layer, method = nn.Module(), PackedInt8Method(group)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.bias = bias
    return layer, method


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_int8_group_layer_one_native_call_or_torch(monkeypatch, dtype):
    """The group layout's CPU product is one native call (it was one INT8 product per group,
    summed by torch) within the bound of the float64 reference; ``KVFLOW_CPU_QUANT=torch``
    runs the dequantizing reference (weight rounded to the activation dtype, its GEMM, the
    bias added and rounded): within ``(3 u_d + gamma_(K+2)) (|x| @ |w|.T + |b|) + u_d |y|``
    of the float64 value."""
    layer, method = _grouped_layer(48, 256, 64, seed=5)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(dtype)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].shape)
        return int8_gemm(*args, **kwargs)

    monkeypatch.setattr(pack_quantized, "int8_gemm", counted)
    monkeypatch.delenv("KVFLOW_CPU_QUANT", raising=False)
    native = method.apply_cpu(layer, x, layer.bias)
    assert calls == [(48, 4)]
    ref, bound = _reference_and_bound(x.float(), layer.weight, layer.weight_scale, layer.bias,
                                      dtype)
    assert native.dtype == dtype and bool(((native.double() - ref).abs() <= bound).all())
    monkeypatch.setenv("KVFLOW_CPU_QUANT", "torch")
    via_torch = method.apply_cpu(layer, x, layer.bias)
    assert len(calls) == 1
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    w = layer.weight.double() * layer.weight_scale.double().repeat_interleave(64, dim=1)
    size = x.double().abs() @ w.abs().T + layer.bias.double().abs()
    gamma = 258 * 2.0 ** -24 / (1 - 258 * 2.0 ** -24)
    assert bool(((via_torch.double() - ref).abs()
                 <= (3 * u + gamma) * size + u * ref.abs()).all())
