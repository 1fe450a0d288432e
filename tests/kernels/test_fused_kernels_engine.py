"""KVFLOW_FUSED_KERNELS=1 inside the whole engine, on CPU with Triton in the interpreter: the
Triton attention backend with the fused rotary + KV-store kernel gives the same greedy tokens
as without it and as the torch backend (the independent reference) on the tiny Llama (mixed
prefill chunks and decodes, prefix-cache hits), and the fused kernel really ran, once per
layer and step, instead of the separate rotary and store kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.test_engine_triton_cpu import _greedy, _llm


def test_fused_kernels_env_value(monkeypatch):
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    monkeypatch.delenv("KVFLOW_FUSED_KERNELS", raising=False)
    assert TritonPagedAttentionBackend().fuse_rotary is False  # default off
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1")
    assert TritonPagedAttentionBackend().fuse_rotary is True
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "yes")
    with pytest.raises(ValueError, match="KVFLOW_FUSED_KERNELS"):
        TritonPagedAttentionBackend()


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_fused_engine_matches_unfused_and_torch(tiny_llama_path, monkeypatch, unfused_greedy):
    """(The unfused and torch runs are shared with tests/kernels/test_engine_triton_cpu.py.)"""
    from kvflow.attention import triton_paged
    from kvflow.kernels import rotary

    reference = unfused_greedy(tiny_llama_path, "torch")
    unfused = unfused_greedy(tiny_llama_path, "triton")
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1")
    llm = _llm(tiny_llama_path, "triton")
    fused_calls = _counting(monkeypatch, triton_paged, "rotary_store_kvcache")
    store_calls = _counting(monkeypatch, triton_paged, "store_kvcache")
    rotary_calls = _counting(monkeypatch, rotary, "rotary_embedding")
    assert _greedy(llm) == unfused == reference
    num_layers = llm.engine.core.executor.runner.model.config.num_hidden_layers
    assert fused_calls and len(fused_calls) % num_layers == 0
    assert not store_calls and not rotary_calls


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_fused_engine_other_families(tiny_model_factory, monkeypatch, name, unfused_greedy):
    """Qwen3 (per-head q/k RMSNorm before the rotation) and Gemma 3 (q/k norms, two RoPE
    tables, sliding-window layers): fused greedy tokens equal unfused ones, the fused kernel
    ran."""
    from kvflow.attention import triton_paged

    path = tiny_model_factory(name).path
    unfused = unfused_greedy(path, "triton")
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1")
    fused_calls = _counting(monkeypatch, triton_paged, "rotary_store_kvcache")
    assert _greedy(_llm(path, "triton")) == unfused
    assert fused_calls


@pytest.mark.parametrize("kv_cache_dtype,fused", [("int8", False), ("fp8_e4m3", True)])
def test_fused_engine_quantized_caches(tiny_llama_path, monkeypatch, kv_cache_dtype, fused,
                                      unfused_greedy):
    """FP8 caches take the fused kernel (quantized in-kernel); INT8 caches, whose keys are
    Hadamard-rotated between the RoPE and the store (QuaRot), keep the separate kernels.
    Either way the greedy tokens equal the unfused engine's (shared with
    tests/kernels/test_engine_triton_cpu.py)."""
    from kvflow.attention import triton_paged

    unfused = unfused_greedy(tiny_llama_path, "triton", kv_cache_dtype)
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1")
    fused_calls = _counting(monkeypatch, triton_paged, "rotary_store_kvcache")
    assert _greedy(_llm(tiny_llama_path, "triton", kv_cache_dtype)) == unfused
    assert bool(fused_calls) == fused
