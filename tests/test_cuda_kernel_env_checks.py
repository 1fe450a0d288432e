"""Bad values of the CUDA-only kernel switches (``KVFLOW_FUSED_KERNELS``,
``KVFLOW_LORA_KERNEL``) are refused by the engine config, before any model loads, as the CPU
kernel switches are: a CPU engine never reads them later, so they went unnoticed there."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig


@pytest.mark.parametrize("variable, value", [("KVFLOW_FUSED_KERNELS", "yes"),
                                             ("KVFLOW_FUSED_KERNELS", ""),
                                             ("KVFLOW_LORA_KERNEL", "cutlass"),
                                             ("KVFLOW_LORA_KERNEL", "")])
def test_bad_cuda_kernel_switch_is_refused_by_the_config(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable}='{value}' is invalid"):
        EngineConfig.from_kwargs(device="cpu")


@pytest.mark.parametrize("variable, value", [("KVFLOW_FUSED_KERNELS", "0"),
                                             ("KVFLOW_FUSED_KERNELS", "1"),
                                             ("KVFLOW_LORA_KERNEL", "torch"),
                                             ("KVFLOW_LORA_KERNEL", "triton")])
def test_good_cuda_kernel_switch_is_kept(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert EngineConfig.from_kwargs(device="cpu").device_config.device == "cpu"
