"""kvflow's native GGUF GEMM (``csrc/cpu_gguf.c``: dequantize inside the product) against
``gguf.quants.dequantize`` (numpy, the llama.cpp formulas) + a torch matmul, for every block
type, at decode (fused kernel) and prefill (native tile dequantization + torch GEMM) row
counts; each ISA level's build (the ``kernels`` fixture: AVX-512, AVX2 and the SSE2 baseline
widen bytes and fp16 scales differently) against the same oracle, fp16 scale edge cases
(subnormals, signed zero, the largest half) included; and the GGUF layer's CPU path against its
plain-torch path, with ``KVFLOW_CPU_GGUF=torch`` selecting the latter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0
from kvflow.layers.linear import RowParallelLinear
from kvflow.quant import gguf as gguf_method
from kvflow.quant.gguf import GGUFLinearMethod, gguf_linear_cpu

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels not built")

# byte offsets of each type's fp16 fields (random bytes there could be NaN or huge)
F16_AT = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2),
          Q6_K: (208,)}


def random_blocks(ggml_type: int, rows: int, blocks: int, seed: int) -> np.ndarray:
    _, nbytes = BLOCK_SHAPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for off in F16_AT[ggml_type]:
        raw[..., off:off + 2] = rng.uniform(-0.05, 0.05, (rows, blocks, 1)) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


def _case(ggml_type: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = 3 if BLOCK_SHAPES[ggml_type][0] == 256 else 18
    raw = random_blocks(ggml_type, rows, blocks, seed)
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type)).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(ref)


@pytest.mark.parametrize("ggml_type", sorted(F16_AT))
def test_native_dequantize_matches_gguf(ggml_type):
    raw, ref = _case(ggml_type, 13, seed=ggml_type)
    got = KERNELS.gguf_dequantize(raw, ggml_type, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)  # FMA contraction: 1 ulp


@pytest.mark.parametrize("ggml_type", sorted(F16_AT))
@pytest.mark.parametrize("m", [1, 3, 15, 17])  # native: passes of 8, 4, 2, 1 rows; 17: torch GEMM
def test_native_gemm_matches_gguf(ggml_type, m):
    raw, ref = _case(ggml_type, 21, seed=m)  # 21 rows: a partial last tile of 8
    x = torch.randn(m, ref.shape[1], generator=torch.Generator().manual_seed(m))
    want = x.double() @ ref.double().T
    got = gguf_linear_cpu(x, raw, ggml_type, KERNELS)
    # fp32 summation over K terms: |error| <= K * eps * sum |x_i w_i| (Higham's gamma_K)
    bound = ref.shape[1] * 2 ** -24 * (x.abs().double() @ ref.abs().double().T)
    assert bool(((got.double() - want).abs() <= bound + 1e-6).all())
    bias = torch.randn(21)
    if m <= 16:
        torch.testing.assert_close(KERNELS.gguf_gemm(x, raw, ggml_type, ref.shape[1], bias),
                                   got + bias, atol=1e-4, rtol=1e-5)


def _gemm_bound(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """fp32 summation over K terms: K eps sum |x_i w_i| (Higham's gamma_K), plus 1e-6."""
    return ref.shape[1] * 2 ** -24 * (x.abs().double() @ ref.abs().double().T) + 1e-6


@pytest.mark.parametrize("ggml_type", sorted(F16_AT))
def test_every_isa_level_matches_gguf(kernels, ggml_type):
    raw, ref = _case(ggml_type, 11, seed=ggml_type + 100)
    got = kernels.gguf_dequantize(raw, ggml_type, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    for m in (1, 3):  # the one-row pass, and the two-row pass then one
        x = torch.randn(m, ref.shape[1], generator=torch.Generator().manual_seed(m))
        out = kernels.gguf_gemm(x, raw, ggml_type, ref.shape[1])
        want = x.double() @ ref.double().T
        assert bool(((out.double() - want).abs() <= _gemm_bound(x, ref)).all())


def test_fp16_scale_edge_cases_at_every_level(kernels):
    """Q8_0 blocks whose fp16 scale is a subnormal (smallest, largest, negative), +-0, the
    smallest normal or +-65504, each exact in fp32: the dequantized values d q are exact products
    of an fp32 scale and |q| <= 128, so they equal gguf's bit for bit."""
    scales = [0x0001, 0x03FF, 0x8001, 0x0000, 0x8000, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xB555]
    raw = random_blocks(Q8_0, 1, len(scales), seed=7).reshape(len(scales), 34)
    raw[:, :2] = np.array(scales, dtype=np.uint16)[:, None].view(np.uint8)
    raw = raw.reshape(1, -1)
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType(Q8_0)).astype(np.float32)
    got = kernels.gguf_dequantize(torch.from_numpy(raw), Q8_0, ref.shape[1])
    assert torch.equal(got, torch.from_numpy(ref))
    assert float(got.abs().max()) > 1e6 and 0 < float(got[0, :32].abs().max()) < 1e-5


def test_bad_inputs_are_value_errors():
    raw, ref = _case(Q8_0, 4, seed=0)
    with pytest.raises(ValueError, match="no native kernel"):
        KERNELS.gguf_gemm(torch.zeros(1, ref.shape[1]), raw, 99, ref.shape[1])
    with pytest.raises(ValueError, match="float32"):
        KERNELS.gguf_gemm(torch.zeros(1, ref.shape[1], dtype=torch.float64), raw, Q8_0,
                          ref.shape[1])


def test_layer_cpu_path_and_the_torch_switch(monkeypatch):
    raw, ref = _case(Q4_1, 16, seed=5)
    raw.ggml_type = Q4_1
    layer = RowParallelLinear(ref.shape[1], 16)
    layer.set_quant_method(GGUFLinearMethod())
    layer.weight.weight_loader(layer.weight, raw)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, ref.shape[1])
    calls = []
    monkeypatch.setattr(gguf_method, "gguf_linear_cpu",
                        lambda *a: calls.append(1) or gguf_linear_cpu(*a))
    torch.testing.assert_close(layer(x), x @ ref.T, atol=1e-4, rtol=1e-4)
    assert calls == [1]
    monkeypatch.setenv("KVFLOW_CPU_GGUF", "torch")
    torch.testing.assert_close(layer(x), x @ ref.T, atol=1e-4, rtol=1e-4)
    assert calls == [1]  # the plain-torch path ran
