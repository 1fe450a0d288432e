"""Native CPU GELU and GELU-and-mul (kernels/csrc/cpu_gelu.c) at every ISA level this CPU runs.

Oracle: float64 GELU written through identities that avoid the cancellation of
``F.gelu``'s own formulas for negative inputs (float64 ``0.5 x (1 + tanh(u))`` is exactly 0
below x ~ -7, where fp32 still holds ~1e-16): ``x * sigmoid(2u)`` for the tanh form and
``0.5 x erfc(-x / sqrt(2))`` for the erf form, each checked against ``F.gelu`` in float64 where
both are accurate. Error bounds follow the kernels' fp32 arithmetic: GELU is x times
``exp(-s)``-based factors with s = |2u| (tanh) or x^2 / 2 (erf); s is computed with a relative
error of a few fp32 units, which exp turns into a relative error of ~s units, plus the fit of
erfc (< 1.2e-7, 2 units), the exp polynomial (2e-7) and a handful of roundings: a relative
``16 (1 + s) 2^-24`` (measured at most 8 over 4M points in [-20, 20] at every level), and an
absolute ``2 exp(-87) (1 + |x|)`` where exp is clamped at -87 (results below ~1e-37 |x|). 16-bit
results are rounded twice where torch rounds (gelu, then the product): one unit roundoff each,
plus one subnormal half-unit per rounding in fp16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import cpu_native
from kvflow.layers.activation import GeluAndMul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = 2.0**-24
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SUBNORMAL_HALF = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0**-25}



def gelu64(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu(x), s) in float64: s the magnitude of exp's argument (see the module doc)."""
    x = x.double()
    if approximate == "tanh":
        v = 2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        return x * torch.sigmoid(v), v.abs()
    return 0.5 * x * torch.erfc(-x / math.sqrt(2)), x * x / 2


def fp32_bound(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact gelu, the bound on the kernel's fp32 gelu's error) for inputs x."""
    exact, s = gelu64(x, approximate)
    return exact, 16 * (1 + s) * EPS32 * exact.abs() + 2 * math.exp(-87) * (1 + x.double().abs())


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_oracle_is_torch_gelu_where_float64_is_accurate(approximate):
    x = torch.linspace(-5, 5, 1001, dtype=torch.float64)
    torch.testing.assert_close(gelu64(x, approximate)[0], F.gelu(x, approximate=approximate),
                               atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 17, 1001])
def test_gelu_rows(kernels, approximate, dtype, width):
    gen = torch.Generator().manual_seed(width)
    wide = (torch.randn(5, width + 3, generator=gen) * 4).to(dtype)
    x = wide[:, :width]  # row stride past the width
    exact, bound_g = fp32_bound(x, approximate)
    unit = UNIT[dtype] if dtype != torch.float32 else 0.0  # fp32: no rounding past the math
    bound = bound_g * (1 + unit) + unit * exact.abs() + SUBNORMAL_HALF[dtype]
    got = kernels.gelu(x, approximate)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 24, 333])
def test_gelu_and_mul_rows(kernels, approximate, dtype, inter):
    """Bounded against float64 gelu(gate) * up, and rounded where torch rounds (gelu to the
    dtype, then the product): equal to the exact gelu so rounded but where it lies so near a
    rounding midpoint that the kernel's fp32 error decides it (a few elements at most). Not
    compared with torch's fp32 gelu itself: its tanh form loses most bits to cancellation for
    gates below about -3."""
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(29, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    exact_g, bound_g = fp32_bound(gate, approximate)
    u, unit, sub = up.double().abs(), UNIT[dtype], SUBNORMAL_HALF[dtype]
    # gelu within bound_g, rounded to the dtype (skipped in fp32), times up, rounded
    bound = u * (bound_g * (1 + unit) ** 2 + exact_g.abs() * ((1 + unit) ** 2 - 1)
                 + sub * (1 + unit)) + sub
    exact = exact_g * up.double()
    got = kernels.gelu_and_mul(x, approximate)
    assert got.shape == (29, inter) and got.dtype == dtype
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    if dtype != torch.float32:
        rounded_twice = exact_g.to(dtype) * up  # the product of 16-bit values, rounded once
        assert int((got != rounded_twice).sum()) <= max(2, got.numel() // 100)


def test_bad_arguments_raise_value_error():
    k = cpu_native.native_cpu_kernels()
    if k is None:
        pytest.skip("native CPU kernels could not be built")
    for call in (lambda: k.gelu_and_mul(torch.randn(4, 7)),             # odd width
                 lambda: k.gelu_and_mul(torch.randn(4, 8).t()),         # column-major rows
                 lambda: k.gelu(torch.randn(4, 8).double()),            # float64
                 lambda: k.gelu(torch.randn(4, 8), approximate="erf")):  # torch's names only
        with pytest.raises(ValueError):
            call()


def test_layer_runs_the_kernel_and_the_torch_path_stays_selectable(monkeypatch):
    """GeluAndMul on CPU rows calls the native kernel (its exact output); with
    KVFLOW_NATIVE_CPU=0 (and for 3-D input) it is plain torch, bit for bit."""
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    layer = GeluAndMul("tanh")
    torch_way = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(layer(x.view(2, 3, 40)), torch_way.view(2, 3, 20))
    kernels = cpu_native.native_cpu_kernels()
    if kernels is not None:
        assert torch.equal(layer(x), kernels.gelu_and_mul(x, "tanh"))
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    cpu_native.native_cpu_kernels.cache_clear()
    try:
        assert cpu_native.native_cpu_kernels() is None
        assert torch.equal(layer(x), torch_way)
    finally:
        monkeypatch.undo()
        cpu_native.native_cpu_kernels.cache_clear()
