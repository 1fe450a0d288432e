"""CPU-only kernel variables (``KVFLOW_CPU_GEMM``, ``KVFLOW_CPU_ATTENTION``, ``KVFLOW_CPU_GGUF``,
``KVFLOW_CPU_QUANT``, ``KVFLOW_CPU_ISA``, ``KVFLOW_CPU_GEMM_POOL=1``,
``KVFLOW_CPU_ADAPTIVE_THREADS=1``) set while the engine runs on another device are named in one
start-up warning: nothing there reads them. The matching options are refused
(tests/test_cpu_only_options.py); a variable may be set machine-wide, so it is only warned
about. A stand-in GPU platform (the CPU platform renamed, its device type "cuda") lets the
start-up check run here; the engine is stopped right after its platform step."""

from __future__ import annotations

import logging

import pytest

from kvflow import LLM
from kvflow.config import EngineConfig
from kvflow.core import engine_startup, unread_options
from kvflow.core.unread_options import unread_setting_warnings, warn_unread_settings
from kvflow.platforms.cpu import CpuPlatform

VARIABLES = ("KVFLOW_CPU_GEMM", "KVFLOW_CPU_ATTENTION", "KVFLOW_CPU_GGUF", "KVFLOW_CPU_QUANT",
             "KVFLOW_CPU_ISA", "KVFLOW_CPU_GEMM_POOL", "KVFLOW_CPU_ADAPTIVE_THREADS",
             "KVFLOW_NATIVE_CPU")


class StandInGpu(CpuPlatform):
    name = "cuda"
    device_type = "cuda"
    default_kv_cache_bytes = None


class StopAfterPlatform(Exception):
    pass


@pytest.fixture
def clean_env(monkeypatch):
    """None of the CPU kernel variables set (the suite's conftest sets
    KVFLOW_CPU_ADAPTIVE_THREADS=0; KVFLOW_NATIVE_CPU=0 is a suite mode)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _warnings_on(device_platform, **kwargs) -> list[str]:
    return unread_setting_warnings(EngineConfig.from_kwargs(model="m", **kwargs),
                                   device_platform)


def test_set_variables_are_named_in_one_line(clean_env):
    clean_env.setenv("KVFLOW_CPU_GEMM", "onednn")
    clean_env.setenv("KVFLOW_CPU_ATTENTION", "sdpa")
    clean_env.setenv("KVFLOW_CPU_GEMM_POOL", "1")
    assert _warnings_on(StandInGpu()) == [
        ("KVFLOW_CPU_GEMM='onednn', KVFLOW_CPU_ATTENTION='sdpa', KVFLOW_CPU_GEMM_POOL='1': "
        "CPU-only settings, which an engine on cuda does not read; unset them (or run with "
        "--device cpu)")]


@pytest.mark.parametrize("variable, value", [("KVFLOW_CPU_GGUF", "torch"),
                                             ("KVFLOW_CPU_QUANT", "native"),
                                             ("KVFLOW_CPU_ADAPTIVE_THREADS", "1"),
                                             ("KVFLOW_CPU_GEMM", "auto")])
def test_each_variable_alone(clean_env, variable, value):
    clean_env.setenv(variable, value)
    assert _warnings_on(StandInGpu()) == [
        (f"{variable}={value!r}: CPU-only setting, which an engine on cuda does not read; "
        "unset it (or run with --device cpu)")]


def test_what_another_device_does_anyway_is_not_named(clean_env):
    """The switches at 0 (what a GPU engine does anyway), KVFLOW_NATIVE_CPU either way, an
    empty KVFLOW_CPU_ISA (unset, as the kernels read it): no warning."""
    clean_env.setenv("KVFLOW_CPU_GEMM_POOL", "0")
    clean_env.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
    clean_env.setenv("KVFLOW_NATIVE_CPU", "0")
    clean_env.setenv("KVFLOW_CPU_ISA", "")
    assert _warnings_on(StandInGpu()) == []


def test_a_cpu_engine_reads_them(clean_env):
    clean_env.setenv("KVFLOW_CPU_GEMM", "onednn")
    clean_env.setenv("KVFLOW_CPU_GEMM_POOL", "1")
    assert _warnings_on(CpuPlatform()) == []


def test_logged_once_per_engine_by_replica_0(clean_env, caplog):
    """Every data-parallel replica runs an engine core with the same environment: replica 0
    logs the line, the others do not."""
    clean_env.setenv("KVFLOW_CPU_ATTENTION", "native")
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        for rank in (0, 1, 2):
            warn_unread_settings(EngineConfig.from_kwargs(
                model="m", data_parallel_size=3, data_parallel_rank=rank), StandInGpu())
    assert [r.getMessage() for r in caplog.records] == [
        ("KVFLOW_CPU_ATTENTION='native': CPU-only setting, which an engine on cuda does not "
        "read; unset it (or run with --device cpu)")]
    assert caplog.records[0].name == unread_options.__name__


def test_the_engine_warns_at_start_up(clean_env, caplog, tiny_llama):
    """The engine core's platform step logs the line once, before any model loads."""
    clean_env.setattr(engine_startup, "get_platform", lambda device: StandInGpu())

    def stop(self, source):
        raise StopAfterPlatform

    clean_env.setattr(engine_startup.EngineCoreStartup, "_init_model", stop)
    clean_env.setenv("KVFLOW_CPU_GEMM", "native")
    with caplog.at_level(logging.WARNING, logger="kvflow"), pytest.raises(StopAfterPlatform):
        LLM(model=tiny_llama.path)
    assert [r.getMessage() for r in caplog.records if "KVFLOW_CPU" in r.getMessage()] == [
        ("KVFLOW_CPU_GEMM='native': CPU-only setting, which an engine on cuda does not read; "
        "unset it (or run with --device cpu)")]


@pytest.mark.parametrize("setting, expected", [
    ({"KVFLOW_FUSED_KERNELS": "1"}, "KVFLOW_FUSED_KERNELS='1': CUDA kernel setting"),
    ({"KVFLOW_LORA_KERNEL": "triton"}, "KVFLOW_LORA_KERNEL='triton': CUDA kernel setting"),
    ({"KVFLOW_FUSED_KERNELS": "1", "KVFLOW_LORA_KERNEL": "triton"},
     "KVFLOW_FUSED_KERNELS='1', KVFLOW_LORA_KERNEL='triton': CUDA kernel settings"),
    ({"KVFLOW_FUSED_KERNELS": "0", "KVFLOW_LORA_KERNEL": "torch"}, None),
])
def test_cuda_only_variables_on_a_cpu_engine(clean_env, setting, expected):
    """The mirror: the Triton attention's fused rotary + store and the grouped LoRA kernel
    are CUDA's; a CPU engine runs the separate ops and plain torch (what 0 / torch ask for,
    so those are not named)."""
    clean_env.delenv("KVFLOW_FUSED_KERNELS", raising=False)
    clean_env.delenv("KVFLOW_LORA_KERNEL", raising=False)
    for name, value in setting.items():
        clean_env.setenv(name, value)
    many = expected is not None and "settings" in expected
    assert _warnings_on(CpuPlatform(), device="cpu") == ([] if expected is None else [
        (f"{expected}, which this engine (cpu, attention backend cpu) does not read; unset "
         f"{'them' if many else 'it'}")])
    assert _warnings_on(StandInGpu(), attention_backend="triton") == []  # CUDA reads them


def test_the_fused_kernels_variable_is_read_by_triton_attention_anywhere(clean_env):
    """KVFLOW_FUSED_KERNELS asks the Triton attention backend, which a CPU engine runs in
    Triton's interpreter (attention_backend='triton'): read there, not named; on CUDA with
    another backend it is unread and named."""
    clean_env.setenv("KVFLOW_FUSED_KERNELS", "1")
    assert _warnings_on(CpuPlatform(), device="cpu", attention_backend="triton") == []
    assert _warnings_on(StandInGpu(), attention_backend="torch") == [
        ("KVFLOW_FUSED_KERNELS='1': CUDA kernel setting, which this engine (cuda, attention "
         "backend torch) does not read; unset it")]
