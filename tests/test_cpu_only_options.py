"""CPU-only engine options (``--cpu-threads``, ``--cpu-threads-bind``, ``--cpu-gemm``,
``--cpu-attention``, ``--cpu-gemm-pool``, ``--cpu-adaptive-threads``, a draft model's
``draft_cpu_threads``) given to an engine on another device are refused, naming them: only a
CPU engine's runner reads them, so on CUDA they were accepted and ignored. A stand-in GPU
platform (the CPU platform renamed, its device type "cuda") lets the start-up check run here;
it raises before any model loads."""

from __future__ import annotations

import pytest

from kvflow import LLM
from kvflow.config import DeviceConfig
from kvflow.core import engine_startup
from kvflow.entrypoints.cli import main
from kvflow.platforms.cpu import CpuPlatform


class StandInGpu(CpuPlatform):
    name = "cuda"
    device_type = "cuda"
    default_kv_cache_bytes = None  # sized from memory, as a GPU's


@pytest.fixture
def on_gpu(monkeypatch):
    """A stand-in GPU platform; KVFLOW_NATIVE_CPU unset (its 0 refuses the options that need
    the native CPU kernels first, whatever the device)."""
    monkeypatch.setattr(engine_startup, "get_platform", lambda device: StandInGpu())
    monkeypatch.delenv("KVFLOW_NATIVE_CPU", raising=False)


@pytest.mark.parametrize("options, named", [
    ({"cpu_threads": 2}, "cpu_threads=2: CPU-only option, "),
    ({"cpu_threads_bind": "0-1"}, "cpu_threads_bind='0-1': CPU-only option, "),
    ({"cpu_gemm": "auto"}, "cpu_gemm='auto': CPU-only option, "),
    ({"cpu_attention": "sdpa", "cpu_gemm_pool": True, "cpu_adaptive_threads": True},
     "cpu_attention='sdpa', cpu_gemm_pool=True, cpu_adaptive_threads=True: CPU-only options, "),
    ({"speculative_config": {"method": "draft_model", "draft_cpu_threads": 1}},
     "speculative_config draft_cpu_threads=1: CPU-only option, "),
])
def test_cpu_options_on_a_gpu_are_refused(on_gpu, tiny_llama, options, named):
    several = named.count("=") > 1
    if "speculative_config" in options:  # the target drafts for itself
        options = {"speculative_config": {**options["speculative_config"],
                                          "model": tiny_llama.path}}
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama.path, **options)
    assert str(e.value) == (f"{named}which an engine on cuda does not read; leave "
                            f"{'them' if several else 'it'} out (or run with --device cpu)")


def test_options_left_unset_or_off_are_no_cpu_options(monkeypatch):
    monkeypatch.delenv("KVFLOW_NATIVE_CPU", raising=False)  # its 0 refuses cpu_gemm native
    assert DeviceConfig().cpu_only_options() == []
    assert DeviceConfig(cpu_gemm_pool=False, cpu_adaptive_threads=False).cpu_only_options() == []
    assert DeviceConfig(cpu_threads=4, cpu_gemm="native").cpu_only_options() == \
        ["cpu_gemm='native'", "cpu_threads=4"]


def test_the_flag_is_one_line(on_gpu, tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama.path, "--cpu-threads", "2", "--max-tokens", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == ("kvflow: error: --cpu-threads=2: CPU-only option, which an engine on "
                        "cuda does not read; leave it out (or run with --device cpu)")


def test_the_same_options_on_a_cpu_still_run(tiny_llama):
    """The check is the device's, not the options': a CPU engine takes them (its runner set
    the process's torch thread count to --cpu-threads)."""
    import torch

    before = torch.get_num_threads()
    try:
        llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", num_kv_blocks=16,
                  cpu_threads=1, cpu_gemm="onednn")
        assert llm.engine.core.platform.name == "cpu" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
