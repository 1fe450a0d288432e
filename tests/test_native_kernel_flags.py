"""Engine options that ask for kvflow's native CPU kernels (``--cpu-gemm native``,
``--cpu-attention native``, ``--cpu-gemm-pool``, ``--attention-backend cpu``) are named in the
warning when the kernels cannot be built. The README promises that fallback (a warning, then
torch's kernels and oneDNN), and the warning named only the environment settings
(``KVFLOW_NATIVE_CPU`` and the like): a user who typed ``--cpu-gemm native`` was told to set
``KVFLOW_NATIVE_CPU=0``, which that flag then made an error. A failed build is simulated with
``CC=/bin/false`` and an empty kernel cache, as tests/kernels/test_cpu_attention.py does.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import DeviceConfig
from kvflow.kernels import cpu_build, cpu_native

OFF = "set KVFLOW_NATIVE_CPU=0 to use torch's kernels without trying to build them"


@pytest.fixture
def failed_build(monkeypatch, tmp_path):
    """The kernels' build fails (a compiler that exits 1, an empty cache), nothing forced by
    the environment; the outcome is forgotten before and after."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    for name in ("KVFLOW_NATIVE_CPU", "KVFLOW_CPU_ISA", "KVFLOW_CPU_GEMM",
                 "KVFLOW_CPU_ATTENTION", "KVFLOW_CPU_GEMM_POOL"):
        monkeypatch.delenv(name, raising=False)
    cpu_native.native_cpu_kernels.cache_clear()
    yield ", ".join(lv.name for lv in cpu_build.isa_levels_for_cpu())
    cpu_native.native_cpu_kernels.cache_clear()


def _warning(levels: str, asked: str, off: str) -> str:
    return (f"kvflow's native CPU kernels did not build with /bin/false (for {levels}), "
            f"torch's kernels are used instead; asked for by {asked}: {off}")


@pytest.mark.parametrize("options, flags", [
    ({}, ()),
    ({"cpu_gemm": "native"}, ("--cpu-gemm native",)),
    ({"cpu_gemm": "onednn", "cpu_attention": "native", "cpu_gemm_pool": True,
      "attention_backend": "cpu"},
     ("--cpu-attention native", "--cpu-gemm-pool", "--attention-backend cpu")),
])
def test_the_options_that_need_the_kernels(options, flags, monkeypatch):
    monkeypatch.delenv("KVFLOW_NATIVE_CPU", raising=False)  # its 0 refuses these options
    assert DeviceConfig(**options).native_kernel_flags() == flags


def test_the_warning_names_the_flags_and_is_logged_once(failed_build, caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.kernels.cpu_native"):
        assert cpu_native.native_cpu_kernels(("--cpu-gemm native",)) is None
        assert cpu_native.native_cpu_kernels() is None  # later calls: no second warning
    finals = [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]
    assert finals == [_warning(failed_build, "--cpu-gemm native, KVFLOW_NATIVE_CPU unset (on "
                               "by default)", f"{OFF} (and drop --cpu-gemm native, which needs "
                               "them)")]


def test_an_engine_given_the_flags_warns_naming_them_and_runs_on_torch(failed_build, caplog,
                                                                       tiny_llama):
    """``LLM(cpu_gemm="native", cpu_attention="native")`` with the build failing: one warning
    naming both flags (the options as the engine got them), then the documented fallback, whose
    greedy output is transformers'."""
    with caplog.at_level(logging.WARNING, logger="kvflow.kernels.cpu_native"):
        llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", num_kv_blocks=32,
                  cpu_gemm="native", cpu_attention="native")
    finals = [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]
    assert finals == [_warning(
        failed_build, "--cpu-gemm native, --cpu-attention native, KVFLOW_NATIVE_CPU unset (on "
        "by default)", f"{OFF} (and drop --cpu-gemm native, --cpu-attention native, which "
        "need them)")]
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == "torch"
    prompt = [5, 17, 42, 99, 7, 23]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    with torch.no_grad():
        ref = tiny_llama.hf_model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                           min_new_tokens=8, do_sample=False)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
