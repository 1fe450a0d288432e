"""CPU step graphs (kvflow/worker/cpu_graphs.py) replay ``--quantization int8`` decode steps:
the INT8 embedding lookup is one native call (``kvflow_int8_embedding_rows``) and a 16-bit
model's linear biases are kept in fp32 once (``worker/cpu_setup.keep_fp32_biases``), so no
torch operator computes in the step. Before, ``aten.embedding`` (and, for 16-bit Qwen2, the
bias widening) made every batch size run eagerly.

Oracle: the same engine with ``enforce_eager=True``: tokens and every logprob bit for bit (a
replay runs the same kernels on the same inputs); the runner's own check replay on a
NaN-filled buffer must reproduce the eager hidden states bit for bit or it turns itself off
(``disabled``), which each test asserts did not happen."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.quant.int8 import Int8EmbeddingMethod, Int8WeightOnlyMethod
from tests.quant.test_stepgraph_prequantized_int8 import _engine, _generate

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")


def _replays_16bit(dtype: str) -> bool:
    """Whether this CPU's native GEMM takes 16-bit activations as they are (AVX512-BF16): on
    others a bf16 model's packed GEMMs widen them with a torch operator (refused)."""
    return dtype == "float32" or \
        native_cpu_kernels().gemm_x_dtype(torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("name,dtype,quantization", [
    ("llama", "float32", "int8"), ("llama_tied", "bfloat16", "int8"),
    ("qwen2", "bfloat16", "int8"), ("qwen2", "bfloat16", None)])
def test_int8_decode_steps_replay(tiny_model_factory, name, dtype, quantization):
    """Several batch sizes are trusted and replayed, each program one C run with the INT8
    lookup (and products) in it; results equal the eager engine's bit for bit. The last case
    (unquantized bf16 Qwen2) checks the fp32 bias copy on the packed-GEMM path."""
    tiny = tiny_model_factory(name)
    expected = _generate(_engine(tiny.path, dtype, quantization=quantization,
                                 enforce_eager=True))
    llm = _engine(tiny.path, dtype, quantization=quantization)
    runner = llm.engine.core.executor.runner
    model = runner.model
    if quantization == "int8":
        assert type(model.model.embed_tokens.quant_method) is Int8EmbeddingMethod
        assert type(model.model.layers[0].mlp.down_proj.quant_method) is Int8WeightOnlyMethod
    if name == "qwen2":
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.bias_fp32.dtype == torch.float32
        assert torch.equal(qkv.bias_fp32, qkv.bias.float())
    got = _generate(llm)
    graphs = runner.graph_runner
    assert graphs.disabled is None
    if _replays_16bit(dtype) or quantization == "int8":
        assert not graphs.refused and graphs.replayed_steps > 0 and len(graphs.programs) >= 2
        for program in graphs.programs.values():  # every call runs from C
            assert len(program.segments) == 1
            names = program.segments[0][1]
            assert isinstance(program.segments[0][0], torch.Tensor)
            if quantization == "int8":
                assert names[0] == "kvflow_int8_embedding_rows" and "kvflow_int8_gemm" in names
    assert got == expected


def test_native_cpu_off_keeps_the_torch_lookup(tiny_model_factory, monkeypatch):
    """``KVFLOW_NATIVE_CPU=0``: the INT8 table gets no native kernels (the torch lookup
    runs); greedy tokens equal the native engine's (the lookup is exact either way; the rest
    of the forward sums in other orders, so not the logprobs)."""
    from kvflow.kernels import cpu_native

    tiny = tiny_model_factory("qwen2")
    native = _engine(tiny.path, "float32", quantization="int8")
    assert native.engine.core.executor.runner.model.model.embed_tokens.native_kernels \
        is not None
    expected = [tokens for tokens, _ in _generate(native)]
    del native
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    cpu_native.native_cpu_kernels.cache_clear()
    try:
        llm = _engine(tiny.path, "float32", quantization="int8")
        model = llm.engine.core.executor.runner.model
        assert getattr(model.model.embed_tokens, "native_kernels", None) is None
        assert [tokens for tokens, _ in _generate(llm)] == expected
    finally:
        monkeypatch.delenv("KVFLOW_NATIVE_CPU")
        cpu_native.native_cpu_kernels.cache_clear()
