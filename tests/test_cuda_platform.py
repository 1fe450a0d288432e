"""The CUDA platform's device checks, without a GPU: torch.cuda's device queries stood in
for by those of a Tesla T4 (compute capability 7.5: bf16 only emulated, no fp8), an A100 (8.0:
bf16, no fp8 in Triton) and an H100 (9.0: both)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvflow.core.engine_dtype import resolve_dtype
from kvflow.platforms.cuda import CudaPlatform

GPUS = {"t4": ("Tesla T4", 7, 5), "a100": ("NVIDIA A100-SXM4-80GB", 8, 0),
        "h100": ("NVIDIA H100 80GB HBM3", 9, 0)}


@pytest.fixture(params=sorted(GPUS))
def gpu(request, monkeypatch) -> str:
    """torch.cuda answers as the named GPU would (torch's own is_bf16_supported and
    get_device_capability run on top of these)."""
    name, major, minor = GPUS[request.param]
    props = SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=80)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # an sm 7.x GPU can make bf16 tensors (emulated), so torch's default check says True
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    return request.param


def test_default_dtype_is_bf16_only_with_bf16_hardware(gpu):
    expected = torch.float16 if gpu == "t4" else torch.bfloat16
    assert CudaPlatform().default_dtype() == expected


def test_auto_dtype_of_a_bf16_checkpoint(gpu):
    cfg = SimpleNamespace(dtype=torch.bfloat16)
    expected = torch.float16 if gpu == "t4" else torch.bfloat16
    assert resolve_dtype("auto", cfg, CudaPlatform()) == expected


def test_explicit_bf16_is_refused_without_bf16_hardware(gpu):
    if gpu != "t4":
        assert resolve_dtype("bfloat16", None, CudaPlatform()) == torch.bfloat16
        return
    with pytest.raises(ValueError, match=r"dtype='bfloat16'.*Tesla T4.*7\.5"):
        resolve_dtype("bfloat16", None, CudaPlatform())


def test_fp8_kv_cache_with_triton_needs_compute_capability_8_9(gpu):
    platform = CudaPlatform()
    platform.check_kv_cache_dtype("int8", "triton")
    platform.check_kv_cache_dtype("fp8_e4m3", "torch")  # torch casts float8 on any GPU
    if gpu == "h100":
        platform.check_kv_cache_dtype("fp8_e4m3", "triton")
        return
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3'.*8\.9.*int8"):
        platform.check_kv_cache_dtype("fp8_e4m3", "triton")


def test_engine_refuses_fp8_kv_cache_before_loading_weights(gpu, tiny_llama, monkeypatch):
    """The refusal reaches LLM(...) at start-up, before any weight is loaded."""
    from kvflow import LLM
    from kvflow.models import loader

    if gpu != "a100":
        pytest.skip("one GPU is enough")
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3'.*A100.*8\.0"):
        LLM(model=tiny_llama.path, device="cuda", kv_cache_dtype="fp8_e4m3",
            skip_tokenizer_init=True)


@pytest.fixture
def no_triton(monkeypatch):
    """``import triton`` fails, as on a CUDA machine without the package."""
    import sys

    from kvflow.platforms import cuda

    clear = getattr(getattr(cuda, "triton_available", None), "cache_clear", lambda: None)
    monkeypatch.setitem(sys.modules, "triton", None)
    clear()
    yield
    clear()


def test_without_triton_cuda_attention_defaults_to_torch(no_triton):
    assert CudaPlatform().default_attention_backend == "torch"


def test_without_triton_an_explicit_triton_backend_is_refused(no_triton):
    from kvflow.worker.attention_backends import make_attention_backend

    with pytest.raises(ValueError, match=r"attention_backend='triton'.*triton package"):
        make_attention_backend("triton")


def test_without_triton_cuda_ops_run_their_torch_code(no_triton):
    from kvflow.layers.norm import RMSNorm

    norm = RMSNorm(8)
    assert norm.implementation_for(torch.device("cuda")) == norm.forward_native
    assert norm.implementation_for(torch.device("cpu")) == norm.forward_cpu


def test_without_triton_deterministic_is_refused_on_cuda(no_triton):
    """--deterministic's CUDA GEMM and attention are Triton kernels: without triton the
    engine would silently run the torch attention backend (not batch-invariant)."""
    from kvflow.config import EngineConfig
    from kvflow.worker.deterministic import unsupported_reasons

    hf_config = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    assert any("triton" in reason for reason in
               unsupported_reasons(EngineConfig(), hf_config, "cuda", None, True))
    assert unsupported_reasons(EngineConfig(), hf_config, "cpu", None, True) == []


def test_fp8_gemm_needs_compute_capability_8_9(gpu):
    from kvflow.platforms.cuda import fp8_gemm_supported

    assert fp8_gemm_supported(torch.device("cuda", 0)) == (gpu == "h100")
    assert fp8_gemm_supported(torch.device("cpu"))


def test_fp8_linear_without_fp8_tensor_cores_runs_the_reference(monkeypatch):
    """W8A8 FP8 on a GPU below 8.9 (A100): the dequantized reference instead of
    torch._scaled_mm, which raises there (here: a _scaled_mm stand-in that raises)."""
    from kvflow.layers.linear import RowParallelLinear
    from kvflow.quant import fp8

    layer = RowParallelLinear(32, 16, bias=False)
    layer.set_quant_method(fp8.Fp8LinearMethod())
    layer.weight.weight_loader(layer.weight, torch.randn(16, 32))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 32)
    expected = layer.quant_method.apply_native(layer, x, None)

    def no_fp8_mm(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute "
                           "capability >= 9.0 or 8.9")

    monkeypatch.setattr(fp8, "scaled_mm_rowwise", no_fp8_mm)
    monkeypatch.setattr(fp8, "fp8_gemm_supported", lambda device: False, raising=False)
    torch.testing.assert_close(layer.quant_method.apply_cuda(layer, x, None), expected)


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch):
    """--attention-backend triton on CPU (no GPU driver for Triton) failed at the first step
    with Triton's '0 active drivers' RuntimeError; it is refused up front unless Triton's
    interpreter is on (TRITON_INTERPRET=1, as the kernel tests run it)."""
    pytest.importorskip("triton")
    from kvflow.worker.attention_backends import make_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton'.*CUDA.*TRITON_INTERPRET"):
        make_attention_backend("triton", device=torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_attention_backend("triton", device=torch.device("cpu")).name == "triton"
