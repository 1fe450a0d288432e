"""The device-dispatch base (kvflow/layers/custom_op.py): which implementation an op runs.

No GPU here, so the CUDA path is reached by registering a stand-in platform that claims CPU
tensors under the name "cuda" (:func:`kvflow.platforms.op_dispatch_key` then answers "cuda" for
them) while the Triton kernels run in the interpreter (TRITON_INTERPRET=1, tests/kernels/
conftest.py). Every result is checked against plain torch written out here: the formulas in
float64 for the Triton and native paths (fp32 inputs, atol=rtol=1e-5), and bit for bit for
``forward_native`` (the same float32 operations in the same order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow import platforms
from kvflow.kernels import cpu_native
from kvflow.layers.activation import GeluAndMul, SiluAndMul
from kvflow.layers.custom_op import CustomOp
from kvflow.layers.moe import FusedMoE
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.platforms.base import Platform
from kvflow.platforms.cpu import CpuPlatform
from kvflow.platforms.cuda import CudaPlatform

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rms_norm_oracle(x, weight, eps, residual=None):
    """float64 RMSNorm of x (+ residual): (normed, new_residual or None)."""
    summed = x.double() if residual is None else x.double() + residual.double()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed, None if residual is None else summed


def rope_oracle(positions, x, theta):
    """float64 neox RoPE of x [T, H, D] (rotate the two halves)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq  # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def moe_oracle(x, w13, w2, router_logits, top_k):
    """float64 dense loop over experts: each token's top-k SwiGLU outputs, renormalized."""
    probs = torch.softmax(router_logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x.double(), w13[e].double()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e].double())
        out += (weights * (ids == e)).sum(-1, keepdim=True) * y
    return out


def _moe_layer(seed: int) -> FusedMoE:
    num_experts, hidden, inter = 4, 32, 24
    layer = FusedMoE(num_experts, 2, hidden, inter, renormalize=True)
    gen = _gen(seed)
    layer.materialize_float_weights()  # built as shapes only (meta) until loaded
    layer.w13_weight.data = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 6
    layer.w2_weight.data = torch.randn(num_experts, hidden, inter, generator=gen) / 5
    return layer


class _Claims(Platform):
    """A platform that owns CPU tensors under another name (the stand-in for a GPU vendor)."""

    device_type = "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def memory_info(self) -> tuple[int, int]:
        return 0, 0


def _claim_cpu_tensors_as(monkeypatch, name: str) -> None:
    """Register a platform named ``name`` that owns "cpu" tensors, ahead of the CPU one."""
    platform = type(f"Claims{name}", (_Claims,), {"name": name})
    monkeypatch.setattr(platforms, "_KNOWN_PLATFORMS", (platform, CpuPlatform, CudaPlatform))


@pytest.fixture
def native_disabled(monkeypatch):
    """KVFLOW_NATIVE_CPU=0 with the kernels' cache cleared, restored afterwards."""
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    cpu_native.native_cpu_kernels.cache_clear()
    yield
    cpu_native.native_cpu_kernels.cache_clear()


def _spy(monkeypatch, cls, method: str) -> list[str]:
    """Record each call of ``cls.method`` (still running it); returns the call list."""
    calls: list[str] = []
    original = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        calls.append(method)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapper)
    return calls


def test_dispatch_keys_come_from_the_platforms():
    assert platforms.op_dispatch_key("cpu") == "cpu"
    assert platforms.op_dispatch_key("cuda") == "cuda"
    assert platforms.op_dispatch_key("xpu") == "xpu"  # no platform owns it: its own name
    norm = RMSNorm(8)
    assert norm.implementation_for(torch.device("cpu")) == norm.forward_cpu
    assert norm.implementation_for(torch.device("cuda")) == norm.forward_cuda
    assert norm.implementation_for(torch.device("meta")) == norm.forward_native


def test_cuda_path_runs_the_triton_kernels(monkeypatch):
    """A call whose device the platform layer names "cuda" runs forward_cuda (Triton in the
    interpreter here) for all four ops; none of them reaches forward_native."""
    pytest.importorskip("triton")
    _claim_cpu_tensors_as(monkeypatch, "cuda")
    native_calls = [_spy(monkeypatch, cls, "forward_native")
                    for cls in (RMSNorm, SiluAndMul, RotaryEmbedding, FusedMoE)]
    cuda_calls = [_spy(monkeypatch, cls, "forward_cuda")
                  for cls in (RMSNorm, SiluAndMul, RotaryEmbedding, FusedMoE)]
    gen = _gen(0)

    norm = RMSNorm(48, eps=1e-6)
    norm.weight.data = torch.rand(48, generator=gen) + 0.5
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    expect_out, expect_res = rms_norm_oracle(x, norm.weight, 1e-6, residual)
    torch.testing.assert_close(norm(x.clone()).double(), rms_norm_oracle(x, norm.weight, 1e-6)[0],
                               **TOL)
    out, new_res = norm(x.clone(), residual.clone())
    torch.testing.assert_close(out.double(), expect_out, **TOL)
    torch.testing.assert_close(new_res.double(), expect_res, **TOL)

    gate_up = torch.randn(6, 2 * 40, generator=gen) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(gate_up).double(), F.silu(gate) * up, **TOL)

    rope = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 3, 16, generator=gen), torch.randn(4, 1, 16, generator=gen)
    expect_q, expect_k = rope_oracle(positions, q, 10000.0), rope_oracle(positions, k, 10000.0)
    out_q, out_k = rope(positions, q, k)
    torch.testing.assert_close(out_q.double(), expect_q, **TOL)
    torch.testing.assert_close(out_k.double(), expect_k, **TOL)

    moe = _moe_layer(seed=1)
    hidden, logits = torch.randn(7, 32, generator=gen), torch.randn(7, 4, generator=gen)
    expected = moe_oracle(hidden, moe.w13_weight, moe.w2_weight, logits, 2)
    torch.testing.assert_close(moe(hidden, logits).double(), expected, atol=1e-4, rtol=1e-4)

    assert [len(c) for c in cuda_calls] == [2, 1, 1, 1]
    assert [len(c) for c in native_calls] == [0, 0, 0, 0]


def test_native_kernels_disabled_runs_forward_native(monkeypatch, native_disabled):
    """KVFLOW_NATIVE_CPU=0: forward_cpu finds no kernels and every op returns exactly the
    plain torch result."""
    assert cpu_native.native_kernels_for(torch.zeros(1)) is None
    calls = [_spy(monkeypatch, cls, "forward_native")
             for cls in (RMSNorm, SiluAndMul, RotaryEmbedding, FusedMoE)]
    gen = _gen(2)

    norm = RMSNorm(48, eps=1e-6)
    norm.weight.data = torch.rand(48, generator=gen) + 0.5
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    summed = x + residual
    expect = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    out, new_res = norm(x, residual)
    assert torch.equal(out, expect) and torch.equal(new_res, summed)

    gate_up = torch.randn(6, 80, generator=gen)
    assert torch.equal(SiluAndMul()(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])

    rope = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.tensor([1, 2, 40])
    q, k = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 1, 16, generator=gen)
    cos, sin = rope.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    q1, q2 = q.chunk(2, dim=-1)
    out_q, _ = rope(positions, q, k)
    assert out_q.data_ptr() != q.data_ptr()  # forward_native returns fresh tensors
    assert torch.equal(out_q, torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1))
    torch.testing.assert_close(out_q.double(), rope_oracle(positions, q, 10000.0), **TOL)

    moe = _moe_layer(seed=3)
    hidden, logits = torch.randn(7, 32, generator=gen), torch.randn(7, 4, generator=gen)
    expected = moe_oracle(hidden, moe.w13_weight, moe.w2_weight, logits, 2)
    torch.testing.assert_close(moe(hidden, logits).double(), expected, **TOL)

    assert [len(c) for c in calls] == [1, 1, 1, 1]


@pytest.mark.skipif(cpu_native.native_cpu_kernels() is None, reason="no native CPU kernels")
def test_cpu_kernel_takes_rows_and_falls_back_on_other_operands(monkeypatch):
    """With the native kernels: 2-D unit-stride rows of one dtype go to the C kernel; a 3-D
    input, or a residual of another dtype, runs forward_native. Both match plain torch."""
    kernel_calls = _spy(monkeypatch, cpu_native.NativeCpuKernels, "rms_norm")
    native_calls = _spy(monkeypatch, RMSNorm, "forward_native")
    gen = _gen(4)
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.data = torch.rand(32, generator=gen) + 0.5
    x = torch.randn(6, 32, generator=gen)
    torch.testing.assert_close(norm(x).double(), rms_norm_oracle(x, norm.weight, 1e-5)[0], **TOL)
    assert (len(kernel_calls), len(native_calls)) == (1, 0)
    x3 = x.view(2, 3, 32)
    torch.testing.assert_close(norm(x3).double(), rms_norm_oracle(x3, norm.weight, 1e-5)[0],
                               **TOL)
    out, _ = norm(x, torch.randn(6, 32, generator=gen).double())  # mixed dtypes
    assert out.dtype == torch.float64
    assert (len(kernel_calls), len(native_calls)) == (1, 2)


def test_a_plugin_platform_gets_its_own_implementation(monkeypatch):
    """A new platform only adds ``forward_<name>`` where it has a kernel: an op that has one
    runs it, an op without one (GeluAndMul) runs forward_native unedited."""
    _claim_cpu_tensors_as(monkeypatch, "npu")

    class NpuSilu(SiluAndMul):
        def forward_npu(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_native(x) * 2  # stands in for a vendor kernel

    x = torch.randn(3, 8, generator=_gen(5))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(NpuSilu()(x), (F.silu(gate) * up) * 2)
    assert torch.equal(GeluAndMul()(x), F.gelu(gate, approximate="tanh") * up)


def test_an_op_without_forward_native_says_so():
    with pytest.raises(NotImplementedError, match="Bare"):
        type("Bare", (CustomOp,), {})()(torch.zeros(2))
