"""KVFLOW_FUSED_KERNELS=1 inside the whole engine, on CPU with Triton in the interpreter: the
Triton attention backend with the fused rotary + KV-store kernel gives the same greedy tokens
as without it and as the torch backend (the independent reference) on the tiny Llama (mixed
prefill chunks and decodes, prefix-cache hits), and the fused kernel really ran, once per
layer and step, instead of the separate rotary and store kernels. The fused runs
(tests/kernels/engine_runs.py ``fused_run``: the engine built with ``KVFLOW_FUSED_KERNELS=1``,
the kernels' calls counted) start ahead in conftest.py's worker process.

The Qwen3 and Gemma 3 cases and the FP8 fused case run only in
scripts/test_distributed_slow.sh (``KVFLOW_TEST_DISTRIBUTED_SLOW=1``; the suite's time budget):
each is a sibling of a kept case through the same code. Qwen3's q/k norms run in
kvflow/models/llama.py before the same ``forward_rotary`` as the tiny Llama's; Gemma 3's
attention class (with q/k norms; a second, local RoPE table is only another cos/sin table for
the same kernel) is Gemma 2's, whose fused engine run with sliding-window layers
tests/kernels/test_softcap_triton_attention.py compares with transformers; the FP8 fused step
is the fused kernel's FP8 store (tests/kernels/test_rotary_kv_store.py) then the attention over
an FP8 cache that test_engine_triton_cpu.py's FP8 case runs in the engine."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

# Marks of a case kept out of the default run (as tests/distributed/conftest.py's SLOW; its
# engine runs are conftest.py's SLOW_RUNS).
SLOW = [pytest.mark.distributed_slow,
        pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                           reason="slow: run scripts/test_distributed_slow.sh")]


def test_fused_kernels_env_value(monkeypatch):
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    monkeypatch.delenv("KVFLOW_FUSED_KERNELS", raising=False)
    assert TritonPagedAttentionBackend().fuse_rotary is False  # default off
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1")
    assert TritonPagedAttentionBackend().fuse_rotary is True
    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "yes")
    with pytest.raises(ValueError, match="KVFLOW_FUSED_KERNELS"):
        TritonPagedAttentionBackend()


def test_fused_engine_matches_unfused_and_torch(tiny_llama_path, unfused_greedy, fused_greedy):
    """(The unfused and torch runs are shared with tests/kernels/test_engine_triton_cpu.py;
    the calls are counted from the first request.)"""
    reference = unfused_greedy(tiny_llama_path, "torch")
    unfused = unfused_greedy(tiny_llama_path, "triton")
    fused = fused_greedy(tiny_llama_path, count_construction=False)
    assert fused.tokens == unfused == reference
    calls = fused.calls["rotary_store_kvcache"]
    assert calls and calls % fused.num_layers == 0
    assert not fused.calls["store_kvcache"] and not fused.calls["rotary_embedding"]


@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=SLOW),
                                  pytest.param("gemma3", marks=SLOW)])
def test_fused_engine_other_families(tiny_model_factory, name, unfused_greedy, fused_greedy):
    """Qwen3 (per-head q/k RMSNorm before the rotation) and Gemma 3 (q/k norms, two RoPE
    tables, sliding-window layers): fused greedy tokens equal unfused ones, the fused kernel
    ran."""
    path = tiny_model_factory(name).path
    fused = fused_greedy(path)
    assert fused.tokens == unfused_greedy(path, "triton")
    assert fused.calls["rotary_store_kvcache"]


@pytest.mark.parametrize("kv_cache_dtype,fused", [
    ("int8", False), pytest.param("fp8_e4m3", True, marks=SLOW)])
def test_fused_engine_quantized_caches(tiny_llama_path, kv_cache_dtype, fused, unfused_greedy,
                                      fused_greedy):
    """FP8 caches take the fused kernel (quantized in-kernel); INT8 caches, whose keys are
    Hadamard-rotated between the RoPE and the store (QuaRot), keep the separate kernels.
    Either way the greedy tokens equal the unfused engine's (shared with
    tests/kernels/test_engine_triton_cpu.py)."""
    run = fused_greedy(tiny_llama_path, kv_cache_dtype)
    assert run.tokens == unfused_greedy(tiny_llama_path, "triton", kv_cache_dtype)
    assert bool(run.calls["rotary_store_kvcache"]) == fused
