"""Weight-only INT8 / INT4: the methods against hand-written dequantization, and the engine on
a tiny Llama against HF transformers running the same dequantized weights.

Oracle: the quantization rules written out here independently (absmax/127 per row for INT8;
per group of G columns ``s = (max - min) / 15``, ``q = round((w - min) / s)``,
``w = q * s + min`` for INT4), applied to the HF model's own weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.quant.int4 import Int4WeightOnlyMethod
from kvflow.quant.int8 import Int8EmbeddingMethod, Int8WeightOnlyMethod


def int8_dequant(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().max(dim=1).values / 127
    return torch.round(w / s[:, None]).clamp(-127, 127) * s[:, None]


def int4_dequant(w: torch.Tensor, group: int) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, group)
    lo = g.min(dim=-1, keepdim=True).values
    s = (g.max(dim=-1, keepdim=True).values - lo) / 15
    return (torch.round((g - lo) / s).clamp(0, 15) * s + lo).reshape(w.shape)


def _loaded_layer(method, weight: torch.Tensor, bias: bool = False):
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], bias=bias)
    layer.set_quant_method(method)
    layer.weight.weight_loader(layer.weight, weight)
    if bias:
        layer.bias.data.normal_()
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_matches_dequantized(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    layer = _loaded_layer(Int8WeightOnlyMethod(), w, bias=True)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (48,)
    ref = x @ int8_dequant(w).T + layer.bias
    tol = 1e-4 if dtype == torch.float32 else 0.15
    for y in (layer(x.to(dtype)), layer.quant_method.apply_native(layer, x.to(dtype), layer.bias)):
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
    assert (int8_dequant(w) - w).abs().max() <= w.abs().max() / 254 + 1e-6


@pytest.mark.parametrize("n,group,dtype", [
    (32, 32, torch.float32),   # fp32: nibble pairs widened for the fp32 GEMM
    (48, 64, torch.bfloat16),  # 16-bit: torch's CPU int4 pack
    (40, 32, torch.bfloat16),  # 40 rows: no CPU int4 pack
])
def test_int4_layer_matches_dequantized(n, group, dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, 128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    w = w.to(dtype).float()  # a weight the model dtype holds exactly
    layer = RowParallelLinear(128, n)
    layer.set_quant_method(Int4WeightOnlyMethod(group))
    layer.weight.data = w.to(dtype)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int4_cpu_packed == (n % 16 == 0 and dtype == torch.bfloat16)
    ref = x.to(dtype).float() @ int4_dequant(w, group).T
    tol = 2e-4 if dtype == torch.float32 else 0.1
    for y in (layer(x.to(dtype)), layer.quant_method.apply_native(layer, x.to(dtype), None)):
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_fused_layers_quantize_per_row_after_loading():
    """q/k/v (and gate/up) land in their rows first, then each output row gets its scale:
    the same as quantizing each projection by itself."""
    qkv = QKVParallelLinear(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2)
    qkv.set_quant_method(Int8WeightOnlyMethod())
    parts = {s: torch.randn(r, 32) for s, r in (("q", 32), ("k", 16), ("v", 16))}
    for shard, t in parts.items():
        qkv.weight.weight_loader(qkv.weight, t, shard)
    qkv.quant_method.process_weights_after_loading(qkv)
    x = torch.randn(2, 32)
    ref = x @ torch.cat([int8_dequant(parts[s]) for s in "qkv"]).T
    torch.testing.assert_close(qkv(x), ref, atol=1e-4, rtol=1e-4)
    merged = MergedColumnParallelLinear(32, [16, 16])
    merged.set_quant_method(Int4WeightOnlyMethod(32))
    gate, up = torch.randn(16, 32), torch.randn(16, 32)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.quant_method.process_weights_after_loading(merged)
    ref = x @ torch.cat([int4_dequant(gate, 32), int4_dequant(up, 32)]).T
    torch.testing.assert_close(merged(x), ref, atol=2e-4, rtol=1e-4)


def _hf_dequantized(tiny, dequant_linear, int8_names: tuple[str, ...] = ()):
    """The HF model with every projection replaced by ``dequant_linear(W)`` (those whose name
    ends with one of ``int8_names``: by INT8 per row) and the embedding and LM head by their
    INT8 per-row dequantization (what kvflow stores)."""
    model = copy.deepcopy(tiny.hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                int8 = name == "lm_head" or name.endswith(int8_names)
                module.weight.copy_((int8_dequant if int8 else dequant_linear)(module.weight))
        emb = model.model.embed_tokens.weight
        emb.copy_(int8_dequant(emb))
    return model


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_matches_hf_on_dequantized_weights(tiny_model_factory, quantization, arch):
    tiny = tiny_model_factory(arch)
    deq = int8_dequant if quantization == "int8" else (lambda w: int4_dequant(w, 32))
    # under int4 the MLP's gate and up projections stay INT8 (llama.cpp-style mix)
    hf = _hf_dequantized(tiny, deq, ("gate_proj", "up_proj") if quantization == "int4" else ())
    prompt = torch.randint(2, tiny.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    llm = LLM(model=tiny.path, dtype="float32", quantization=quantization, num_kv_blocks=64,
              block_size=4)
    (out,) = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=6,
                                                            ignore_eos=True, logprobs=1),
                          use_tqdm=False)
    ids = torch.tensor([prompt.tolist() + out.outputs[0].token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
    for step, token in enumerate(out.outputs[0].token_ids):
        top2 = ref[step].topk(2).values
        if token != int(ref[step].argmax()):
            assert float(top2[0] - top2[1]) < 1e-3, f"step {step}: not a near-tie"
            break
        assert out.outputs[0].logprobs[step][token].logprob == \
            pytest.approx(float(ref[step, token]), abs=2e-4)
    runner = llm.engine.core.executor.runner
    layer = runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == \
        (torch.int8 if quantization == "int8" else torch.uint8)
    assert layer.self_attn.qkv_proj.weight.dtype == layer.mlp.down_proj.weight.dtype
    assert layer.mlp.gate_up_proj.weight.dtype == torch.int8
    unquantized = LLM(model=tiny.path, dtype="float32", num_kv_blocks=64, block_size=4)
    assert runner.weight_bytes < unquantized.engine.core.executor.runner.weight_bytes


@pytest.mark.parametrize("rows", [1, 2, 5])  # native kernel (KVFLOW_CPU_QUANT=torch: int8pack, widened)
def test_int8_lm_head_logits_in_fp32(rows):
    """The INT8 vocabulary table's logits equal hidden @ (q * s).T in fp32 (a plain torch
    reference on the table rounded by the rule written out here), whichever path runs."""
    gen = torch.Generator().manual_seed(rows)
    table, hidden = torch.randn(300, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    layer = torch.nn.Module()
    method = Int8EmbeddingMethod()
    method.create_weights(layer, 300, 64, torch.float32)
    layer.weight.data.copy_(table)
    method.process_weights_after_loading(layer)
    s = table.abs().amax(-1, keepdim=True) / 127
    ref = hidden @ (torch.round(table / s).clamp(-127, 127) * s).T
    out = method.logits(layer, hidden.bfloat16() if rows == 2 else hidden)
    assert out.dtype == torch.float32 and out.shape == (rows, 300)
    if rows == 2:  # bf16 hidden states: the reference of the same (rounded) rows
        ref = hidden.bfloat16().float() @ (torch.round(table / s).clamp(-127, 127) * s).T
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_int4_group_that_a_tensor_parallel_shard_splits_is_refused_before_loading():
    """TP=2 leaves a row-parallel layer of 64 input columns 32 per rank: groups of 64 would
    straddle the ranks, refused when the layer is built (before any weight is read), naming
    the per-rank width; one process takes the same group size."""
    layer = RowParallelLinear(64, 16, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"quantization_group_size=64 does not divide the 32 "
                       r"input columns each of tensor_parallel_size=2 ranks holds of a "
                       r"64-column layer.*divides 32"):
        layer.set_quant_method(Int4WeightOnlyMethod(64))
    RowParallelLinear(64, 16).set_quant_method(Int4WeightOnlyMethod(64))
    with pytest.raises(ValueError, match=r"does not divide a layer's 48 input columns"):
        RowParallelLinear(48, 16).set_quant_method(Int4WeightOnlyMethod(32))


def test_int4_group_size_left_out_is_32_and_given_is_kept():
    """``--quantization-group-size`` left out (None, so that an explicit 32 with another
    scheme can be refused) builds int4 with groups of 32 columns, the documented default."""
    from types import SimpleNamespace

    from kvflow.config import EngineConfig
    from kvflow.quant import get_quant_config

    hf = SimpleNamespace()  # no quantization_config: a float checkpoint
    for given, expected in ((None, 32), (64, 64)):
        mc = EngineConfig.from_kwargs(quantization="int4",
                                      quantization_group_size=given).model_config
        quant = get_quant_config(mc.quantization, hf, "hf", mc.quantization_group_size)
        assert quant.linear_method("model.layers.0.self_attn.o_proj").group_size == expected
