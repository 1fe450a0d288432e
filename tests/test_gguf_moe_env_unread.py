"""``KVFLOW_GGUF_MOE`` (how ``--quantization gguf`` holds an MoE GGUF file's experts) set
where nothing reads it (another quantization, or a model that is not an MoE GGUF file) is
named in one start-up warning, as the CPU-only variables are (tests/test_cpu_only_environment.py);
the MoE GGUF case that reads it is tests/models/test_moe_gguf.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvflow import LLM
from kvflow.config import EngineConfig
from kvflow.core import engine_startup, unread_options
from kvflow.core.unread_options import unread_model_setting_warnings, warn_unread_model_settings

NOT_GGUF = ("KVFLOW_GGUF_MOE='dequantized' has no effect: it chooses how --quantization gguf "
            "holds an MoE GGUF file's experts, and the model is not loaded with "
            "--quantization gguf; unset it")


class StopAfterConfig(Exception):
    pass


def _warnings(arch: str, **kwargs) -> list[str]:
    return unread_model_setting_warnings(EngineConfig.from_kwargs(model="m", **kwargs),
                                         SimpleNamespace(architectures=[arch]))


@pytest.mark.parametrize("value", ["dequantized", "float"])
def test_named_without_gguf_quantization(monkeypatch, value):
    monkeypatch.setenv("KVFLOW_GGUF_MOE", value)
    assert _warnings("Qwen3MoeForCausalLM") == [NOT_GGUF.replace("'dequantized'", repr(value))]
    assert _warnings("Qwen3MoeForCausalLM", quantization="int8") == \
        [NOT_GGUF.replace("'dequantized'", repr(value))]


def test_named_for_a_dense_gguf_model(monkeypatch):
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    assert _warnings("LlamaForCausalLM", quantization="gguf") == [
        ("KVFLOW_GGUF_MOE='dequantized' has no effect: it chooses how --quantization gguf "
         "holds an MoE GGUF file's experts, and LlamaForCausalLM is not a mixture-of-experts "
         "GGUF model; unset it")]


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                  "Qwen3MoeForCausalLM", "GraniteMoeForCausalLM"])
def test_not_named_where_read(monkeypatch, arch):
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    assert _warnings(arch, quantization="gguf") == []


def test_default_or_unset_not_named(monkeypatch):
    monkeypatch.delenv("KVFLOW_GGUF_MOE", raising=False)
    assert _warnings("LlamaForCausalLM") == []
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "quantized")  # what every engine does anyway
    assert _warnings("LlamaForCausalLM") == []


def test_logged_by_replica_0_only(monkeypatch, caplog):
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"])
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        for rank in (0, 1):
            warn_unread_model_settings(EngineConfig.from_kwargs(
                model="m", data_parallel_size=2, data_parallel_rank=rank), hf_config)
    assert [r.getMessage() for r in caplog.records] == [NOT_GGUF]
    assert caplog.records[0].name == unread_options.__name__


def test_the_engine_warns_once_model_config_is_read(monkeypatch, caplog, tiny_llama):
    """The engine core logs it once its model's config is read, before any weight loads."""
    def stop(self):
        raise StopAfterConfig

    monkeypatch.setattr(engine_startup.EngineCoreStartup, "_check_cpu_threads", stop)
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    with caplog.at_level(logging.WARNING, logger="kvflow"), pytest.raises(StopAfterConfig):
        LLM(model=tiny_llama.path)
    assert [r.getMessage() for r in caplog.records if "KVFLOW_GGUF_MOE" in r.getMessage()] \
        == [NOT_GGUF]
