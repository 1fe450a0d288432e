"""Quantized MoE experts (``--quantization int8|fp8``): the FusedMoE layer against a dense
per-expert loop on weights rounded here by the schemes' rules (INT8 absmax/127 per row of each
expert; FP8 absmax/448 per expert for each of gate, up, down, with FP8-rounded activations
per token), and the engine on tiny Mixtral / Qwen3-MoE against transformers whose expert
weights are rounded the same way."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.layers.moe import FusedMoE
from kvflow.quant.moe import Fp8FusedMoEMethod, Int8FusedMoEMethod

E4M3 = torch.float8_e4m3fn


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(w / s).clamp(-127, 127) * s


def fp8_round(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t / scale).clamp(-448, 448).to(E4M3).float() * scale


def fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    return fp8_round(w, w.abs().max() / 448)


def fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    return fp8_round(x, x.abs().amax(dim=-1, keepdim=True) / 448)


def dense_moe(x, w1, w3, w2, router_logits, top_k, renormalize, act=lambda t: t):
    """Every expert on every token, weighted by its routing weight (0 where unpicked); ``act``
    rounds each GEMM's input."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        weight = (vals * (ids == e)).sum(-1)
        h = act(x)
        y = F.linear(act(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e])), w2[e])
        out += weight[:, None] * y
    return out


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_quantized_experts_match_dense_loop(scheme, num_tokens):
    experts, hidden, inter, top_k = 6, 32, 48, 2
    gen = torch.Generator().manual_seed(num_tokens)
    w1, w3 = (torch.randn(experts, inter, hidden, generator=gen) / 6 for _ in range(2))
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 7
    w3[2] *= 8  # up of expert 2 much larger than its gate: gate and up keep separate scales
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
    layer.set_quant_method(Int8FusedMoEMethod() if scheme == "int8" else Fp8FusedMoEMethod())
    for e in range(experts):
        layer.w13_weight.weight_loader(layer.w13_weight, w1[e], "w1", e)
        layer.w13_weight.weight_loader(layer.w13_weight, w3[e], "w3", e)
        layer.w2_weight.weight_loader(layer.w2_weight, w2[e], "w2", e)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, experts, generator=gen)
    if scheme == "int8":
        assert layer.w13_weight.dtype == torch.int8 and layer.w2_weight_scale.shape == (6, 32)
        rw = [torch.stack([int8_rows(m) for m in w]) for w in (w1, w3, w2)]
        expected = dense_moe(x, *rw, logits, top_k, True)
    else:
        assert layer.w13_weight.dtype == E4M3
        rw = [torch.stack([fp8_tensor(m) for m in w]) for w in (w1, w3, w2)]
        expected = dense_moe(x, *rw, logits, top_k, True, act=fp8_tokens)
    torch.testing.assert_close(layer(x, logits), expected, atol=2e-5, rtol=1e-4)
    plain = dense_moe(x, w1, w3, w2, logits, top_k, True)
    assert (plain - expected).abs().max() > 1e-4  # the rounding is visible


def _hf_rounded(tiny, scheme: str):
    """The HF MoE model with each expert's gate/up/down rounded by ``scheme`` (INT8 or FP8
    weights); for FP8 each expert GEMM's input is rounded per token as well."""
    model = copy.deepcopy(tiny.hf_model)
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            with torch.no_grad():
                gu, down = module.gate_up_proj, module.down_proj
                inter = down.shape[-1]
                for e in range(gu.shape[0]):
                    if scheme == "int8":
                        gu[e] = int8_rows(gu[e])
                        down[e] = int8_rows(down[e])
                    else:
                        gu[e] = torch.cat([fp8_tensor(gu[e, :inter]), fp8_tensor(gu[e, inter:])])
                        down[e] = fp8_tensor(down[e])
            if scheme == "fp8":
                module.forward = _fp8_experts_forward.__get__(module)
    return model


def _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' per-expert loop (MixtralExperts.forward) with each GEMM input rounded to
    FP8 per token."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.gate_up_proj.shape[0]):
        pos, token = torch.where((top_k_index == e).T)
        if token.numel() == 0:
            continue
        gate, up = F.linear(fp8_tokens(hidden_states[token]), self.gate_up_proj[e]).chunk(2, -1)
        y = F.linear(fp8_tokens(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, token, y * top_k_weights[token, pos, None])
    return out


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_engine_quantized_experts_match_hf(tiny_model_factory, scheme, arch):
    tiny = tiny_model_factory(arch)
    prompt = torch.randint(2, tiny.vocab_size, (10,), generator=torch.Generator().manual_seed(4))
    llm = LLM(model=tiny.path, dtype="float32", quantization=scheme, num_kv_blocks=64,
              block_size=4)
    (out,) = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=1,
                                                            prompt_logprobs=0), use_tqdm=False)
    hf = _hf_rounded(tiny, scheme)
    _round_dense(hf, scheme)
    with torch.no_grad():
        ref = torch.log_softmax(hf(prompt.unsqueeze(0)).logits[0], dim=-1)
    got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    want = [float(ref[i, t]) for i, t in enumerate(prompt.tolist()[1:])]
    # fp8 rounds each expert GEMM's input to FP8 (3 mantissa bits): a last-bit difference in
    # an input can move one value across a rounding boundary, a step of 1/16 of it (seen:
    # 1.8e-3 on one logprob of 9, torch kernels on an AVX2 CPU)
    assert got == pytest.approx(want, abs=5e-3 if scheme == "fp8" else 5e-4)
    experts = llm.engine.core.executor.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == (torch.int8 if scheme == "int8" else E4M3)


def _round_dense(model, scheme: str) -> None:
    """Round HF's dense projections as kvflow's dense methods do (INT8: per row, the tables
    too; FP8: per tensor with per-token inputs, the LM head unrounded)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if scheme == "int8":
                module.weight.copy_(int8_rows(module.weight))
            elif name != "lm_head":
                module.weight.copy_(fp8_tensor(module.weight))
                module.register_forward_pre_hook(lambda m, a: (fp8_tokens(a[0]),))
        if scheme == "int8":
            emb = model.model.embed_tokens.weight
            emb.copy_(int8_rows(emb))
