"""FP8 W8A8 (``--quantization fp8``): the layer against FP8 rounding written out here
(per-tensor weight scale absmax/448, per-token activation scale absmax/448, e4m3 casts), the
CUDA path's ``torch._scaled_mm`` call (it runs on this CPU build of torch) against the same
reference, and the engine on a tiny Llama against HF transformers running the FP8-rounded
weights with FP8-rounded activations (forward pre-hooks)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.linear import QKVParallelLinear, RowParallelLinear
from kvflow.quant.fp8 import Fp8LinearMethod

E4M3 = torch.float8_e4m3fn


def fp8_round(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t rounded through e4m3 with ``scale`` and scaled back (float32)."""
    return (t / scale).clamp(-448, 448).to(E4M3).float() * scale


def fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    return fp8_round(w, w.abs().max() / 448)


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    return fp8_round(x, x.abs().amax(dim=-1, keepdim=True) / 448)


def _fp8_layer(weight: torch.Tensor, bias: bool = False) -> RowParallelLinear:
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], bias=bias)
    layer.set_quant_method(Fp8LinearMethod())
    layer.weight.weight_loader(layer.weight, weight)
    if bias:
        layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_layer_matches_fp8_rounding(dtype):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=gen), torch.randn(5, 64, generator=gen)
    x[2] *= 30  # rows of different magnitude: one scale per token
    layer = _fp8_layer(w, bias=True)
    assert layer.weight.dtype == E4M3 and layer.weight_scale.shape == (48,)
    assert float(layer.weight_scale[0]) == pytest.approx(float(w.abs().max() / 448))
    xd = x.to(dtype)
    ref = fp8_rows(xd.float()) @ fp8_tensor(w).T + layer.bias
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for y in (layer(xd), layer.quant_method.apply_cuda(layer, xd, layer.bias)):
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max(), rtol=tol)
    # FP8 is coarse: e4m3 keeps 3 mantissa bits, a relative error of at most 2^-4 per value
    rel = ((fp8_tensor(w) - w).abs() / w.abs().clamp(min=w.abs().max() / 64)).max()
    assert rel <= 2 ** -4 + 1e-6


def test_fused_layer_gets_one_scale_per_shard():
    """--quantization fp8 quantizes q, k and v of the fused layer with a scale each."""
    layer = QKVParallelLinear(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2)
    layer.set_quant_method(Fp8LinearMethod())
    parts = {"q": torch.randn(32, 32), "k": torch.randn(16, 32) * 4, "v": torch.randn(16, 32)}
    for shard, t in parts.items():
        layer.weight.weight_loader(layer.weight, t, shard)
    layer.quant_method.process_weights_after_loading(layer)
    scales = torch.cat([t.abs().max().expand(len(t)) / 448 for t in parts.values()])
    torch.testing.assert_close(layer.weight_scale, scales)
    x = torch.randn(3, 32)
    full = torch.cat([fp8_tensor(t) for t in parts.values()])
    torch.testing.assert_close(layer(x), fp8_rows(x) @ full.T, atol=1e-4, rtol=1e-4)


def _hf_fp8(tiny):
    """HF model with FP8-rounded projection weights and FP8-rounded inputs to each projection
    (the embedding and LM head unquantized, as kvflow leaves them)."""
    model = copy.deepcopy(tiny.hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(fp8_tensor(module.weight))
                module.register_forward_pre_hook(lambda m, a: (fp8_rows(a[0]),))
    return model


def test_engine_fp8_matches_hf_fp8_rounding(tiny_model_factory):
    tiny = tiny_model_factory("llama")
    prompt = torch.randint(2, tiny.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    llm = LLM(model=tiny.path, dtype="float32", quantization="fp8", num_kv_blocks=64,
              block_size=4)
    (out,) = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=6,
                                                            ignore_eos=True, logprobs=1),
                          use_tqdm=False)
    ids = torch.tensor([prompt.tolist() + out.outputs[0].token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(_hf_fp8(tiny)(ids).logits[0, len(prompt) - 1:], dim=-1)
    for step, token in enumerate(out.outputs[0].token_ids):
        if token != int(ref[step].argmax()):
            top2 = ref[step].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"step {step}: not a near-tie"
            break
        assert out.outputs[0].logprobs[step][token].logprob == \
            pytest.approx(float(ref[step, token]), abs=2e-4)
    model = llm.engine.core.executor.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == E4M3
