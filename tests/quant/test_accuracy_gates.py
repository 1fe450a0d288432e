"""Accuracy gates on a tiny model: how far each quantization moves the engine's prompt
logprobs from the unquantized model, against a matched-noise oracle.

Metric: the RMS over every scored position of ``logprob_quantized(token) - logprob_ref(token)``
(the engine's prompt logprobs of the shipped text's first windows, tiny random Llama, fp32).

Tolerance, and why: to first order a logprob moves linearly with a perturbation of the weights
(or of the K/V rows, or of the activations), so two zero-mean perturbations that are
independent of the inputs and have the same variance per row move the logprobs by the same
expected squared amount. The oracle is the unquantized HF transformers model with Gaussian
noise added where the scheme rounds, with each row's noise RMS equal to the RMS of that row's
rounding error (computed here with the rule written out in plain torch, or with the ``gguf``
package's own quantizer). Each scheme's error must lie within a factor of 2 of the noise
oracle's (mean of 3 draws) in both directions. Measured on this model: the draws agree within
±8% of each other; the real rounding gives 0.97-1.07x the noise for the weight schemes (INT8,
INT4, FP8 W8A8, GGUF Q8_0, Q4_0) and 1.36x for the KV-cache schemes. A factor of 2 is then
far from both the measured spread and the failures it is there to catch: a scale off by 2x
or more, a lost zero point or a wrong group layout (errors several times the noise), or a
layer that was not quantized at all or ran a finer scheme than asked (int4 that ran int8 is
0.08x). Noise draws that scale with the rounding error also keep the gate meaningful for
every scheme, where a fixed tolerance would be loose for INT8 and tight for INT4.

The issue's perplexity gates (INT8 <= +1.5%, INT4 <= +8%, KV INT8 <= +1%, KV FP8 <= +2%) are
also asserted here, as upper bounds only: on random weights perplexity is near the vocabulary
size and rounding can lower it (INT4 does, by ~2%), so they are weak here; the real-model
figures (SmolLM2-135M, gemma-3-270m) come from ``benchmarks/quant_gates.py``, recorded in
docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.bench.perplexity import DEFAULT_TEXT

gguf = pytest.importorskip("gguf")
GGML = gguf.GGMLQuantizationType

WINDOW, NUM_WINDOWS, NOISE_DRAWS, FACTOR = 128, 3, 3, 2.0
PPL_GATES = {"int8": 1.015, "int4": 1.08, "kv_int8": 1.01, "kv_fp8": 1.02}
Rounder = Callable[[torch.Tensor], torch.Tensor]  # a tensor as its scheme gives it back


# ---------------------------------------------------------------- rounding rules, plain torch

def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """INT8, one absmax/127 scale per row (linears and vocabulary tables under int8/int4)."""
    s = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    return torch.round(w / s).clamp(-127, 127) * s


def int4_groups(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """INT4 asymmetric, (max - min) / 15 and a zero point per group of 32 input columns."""
    n, k = w.shape
    x = w.view(n, k // group, group)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (torch.round((x - lo) / s).clamp(0, 15) * s + lo).view(n, k)


def hadamard_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """INT8 keys as the cache stores them: each row rotated by the orthonormal Hadamard
    matrix of its length (scipy's Sylvester construction), rounded per row, rotated back."""
    from scipy.linalg import hadamard

    h = torch.from_numpy(hadamard(x.shape[-1])).to(x.dtype) / math.sqrt(x.shape[-1])
    return int8_rows(x @ h) @ h.T


def fp8_scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 weight, one absmax/448 scale per checkpoint tensor."""
    return fp8_scaled(w, w.abs().amax() / 448)


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3, one absmax/448 scale per row (activations per token; K/V per token-head)."""
    return fp8_scaled(x, (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-30))


def ggml_rounder(qtype: int) -> Rounder:
    """A llama.cpp block type through the gguf package's own quantizer and dequantizer."""
    def rounder(w: torch.Tensor) -> torch.Tensor:
        raw = gguf.quants.quantize(w.numpy(), GGML(qtype))
        return torch.from_numpy(gguf.quants.dequantize(raw, GGML(qtype)).astype(np.float32))
    return rounder


# name -> engine kwargs, and where the scheme rounds: (linears, vocabulary tables, activations
# entering decoder linears, (K rows, V rows)); a linears dict picks a rule per projection name
SCHEMES: dict[str, tuple[dict, tuple]] = {
    "int8": ({"quantization": "int8"}, (int8_rows, int8_rows, None, None)),
    "int4": ({"quantization": "int4"}, ({"*": int4_groups, "gate_proj": int8_rows,
                                          "up_proj": int8_rows}, int8_rows, None, None)),
    "fp8": ({"quantization": "fp8"}, (fp8_tensor, None, fp8_rows, None)),
    "kv_int8": ({"kv_cache_dtype": "int8"}, (None, None, None,
                                             (hadamard_int8_rows, int8_rows))),
    "kv_fp8": ({"kv_cache_dtype": "fp8_e4m3"}, (None, None, None, (fp8_rows, fp8_rows))),
    "gguf_q8_0": ({"quantization": "gguf"}, (ggml_rounder(GGML.Q8_0), ggml_rounder(GGML.Q8_0),
                                             None, None)),
    "gguf_q4_0": ({"quantization": "gguf"}, (ggml_rounder(GGML.Q4_0), ggml_rounder(GGML.Q8_0),
                                             None, None)),
}


# ---------------------------------------------------------------- the noise oracle (HF)

def matched_noise(x: torch.Tensor, rounder: Rounder, gen: torch.Generator) -> torch.Tensor:
    """``x`` plus Gaussian noise whose RMS in each row equals that row's rounding error's."""
    rms = (rounder(x.float()) - x.float()).pow(2).mean(-1, keepdim=True).sqrt()
    return x + (torch.randn(x.shape, generator=gen) * rms).to(x.dtype)


def noisy_hf_model(hf_model, rules: tuple, gen: torch.Generator):
    """A copy of ``hf_model`` with matched noise in the weights the scheme rounds, and hooks
    that add it to the activations entering decoder linears (W8A8)."""
    linear_rule, table_rule, act_rule, _ = rules
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_table = "embed_tokens" in name or "lm_head" in name
            rule = table_rule if is_table else linear_rule
            if isinstance(rule, dict):  # per projection: {"*": default, "gate_proj": ...}
                rule = next((r for k, r in rule.items() if f".{k}." in name), rule["*"])
            if p.dim() == 2 and rule is not None:
                p.copy_(matched_noise(p.data, rule, gen))
    if act_rule is not None:
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(
                    lambda _m, args: (matched_noise(args[0], act_rule, gen),))
    return model


def hf_token_logprobs(model, windows: list[list[int]],
                      kv_rule: tuple[Rounder, Rounder] | None = None,
                      gen: torch.Generator | None = None) -> torch.Tensor:
    """[scored positions] log p(token | window prefix); ``kv_rule`` (key rule, value rule):
    matched noise on every key/value row (post-RoPE, per token and KV head) as the cache
    stores it."""
    from transformers import DynamicCache

    class NoisyCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(matched_noise(key_states, kv_rule[0], gen),
                                  matched_noise(value_states, kv_rule[1], gen),
                                  layer_idx, *args, **kwargs)

    out = []
    with torch.no_grad():
        for ids in windows:
            cache = NoisyCache() if kv_rule is not None else None
            logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
            lp = torch.log_softmax(logits[0].float(), dim=-1)[:-1]
            out.append(lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
    return torch.cat(out)


# ---------------------------------------------------------------- engine side

def engine_token_logprobs(model: str, windows: list[list[int]], **engine) -> torch.Tensor:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=64, block_size=8,
              skip_tokenizer_init=True, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    return torch.tensor([step[token].logprob for out in outs
                         for token, step in zip(out.prompt_token_ids[1:],
                                                out.prompt_logprobs[1:])])


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def perplexity(token_logprobs: torch.Tensor) -> float:
    return math.exp(-float(token_logprobs.mean()))


# ---------------------------------------------------------------- a GGUF of the tiny model

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF q/k row order -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    base = hf_name.removesuffix(".weight")
    if base in ("model.embed_tokens", "lm_head", "model.norm"):
        return {"model.embed_tokens": "token_embd", "lm_head": "output",
                "model.norm": "output_norm"}[base] + ".weight"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.weight"


def write_tiny_gguf(hf_model, path: str, linear_type: int, table_type: int) -> str:
    """The tiny Llama as a llama.cpp GGUF: 2-D weights quantized (tables to ``table_type``),
    norms F32, q/k rows permuted the way llama.cpp stores them."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    for name, p in hf_model.state_dict().items():
        array = p.float().numpy()
        if ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if array.ndim == 1:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
            continue
        qtype = table_type if ("embed_tokens" in name or "lm_head" in name) else linear_type
        w.add_tensor(gguf_name(name), gguf.quants.quantize(np.ascontiguousarray(array),
                                                           GGML(qtype)), raw_dtype=GGML(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- the gates

@pytest.fixture(scope="module")
def setting(tiny_model_factory, tiny_tokenizer, tmp_path_factory):
    """(tiny model, windows of the shipped text, HF reference logprobs, engine unquantized
    logprobs, the GGUF paths)."""
    tiny = tiny_model_factory("llama")
    ids = tiny_tokenizer.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))
    windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(NUM_WINDOWS)]
    ref = hf_token_logprobs(tiny.hf_model, windows)
    base = engine_token_logprobs(tiny.path, windows)
    folder = tmp_path_factory.mktemp("tiny_gguf")
    ggufs = {"gguf_q8_0": write_tiny_gguf(tiny.hf_model, str(folder / "q8_0.gguf"),
                                          GGML.Q8_0, GGML.Q8_0),
             "gguf_q4_0": write_tiny_gguf(tiny.hf_model, str(folder / "q4_0.gguf"),
                                          GGML.Q4_0, GGML.Q8_0)}
    return tiny, windows, ref, base, ggufs


def test_unquantized_engine_is_the_reference(setting):
    """The baseline the gates measure from: the engine unquantized equals transformers."""
    _, _, ref, base, _ = setting
    assert ref.numel() == NUM_WINDOWS * (WINDOW - 1)
    torch.testing.assert_close(base, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_error_matches_the_noise_oracle(setting, scheme):
    tiny, windows, ref, base, ggufs = setting
    engine_kwargs, rules = SCHEMES[scheme]
    quant = engine_token_logprobs(ggufs.get(scheme, tiny.path), windows, **engine_kwargs)
    error = rms(quant - base)
    gen = torch.Generator().manual_seed(0)
    noise = [rms(hf_token_logprobs(noisy_hf_model(tiny.hf_model, rules, gen), windows,
                                   rules[3], gen) - ref) for _ in range(NOISE_DRAWS)]
    oracle = sum(noise) / len(noise)
    ratio = error / oracle
    print(f"{scheme}: RMS logprob error {error:.5f}, noise oracle {oracle:.5f} "
          f"(draws {', '.join(f'{n:.5f}' for n in noise)}), ratio {ratio:.3f}; perplexity "
          f"{perplexity(base):.3f} -> {perplexity(quant):.3f}")
    assert 1 / FACTOR <= ratio <= FACTOR, \
        f"{scheme}: logprob error {error:.5f} is {ratio:.2f}x the matched noise's {oracle:.5f}"
    if scheme in PPL_GATES:
        assert perplexity(quant) / perplexity(base) <= PPL_GATES[scheme]


def test_gguf_kept_quantized_equals_dequantized_load(setting):
    """The issue's GGUF gate (same perplexity as the dequantized load within 0.1%), here
    tighter: the same blocks kept or widened at load give the same logprobs."""
    _, windows, _, _, ggufs = setting
    kept = engine_token_logprobs(ggufs["gguf_q4_0"], windows, quantization="gguf")
    widened = engine_token_logprobs(ggufs["gguf_q4_0"], windows)
    torch.testing.assert_close(kept, widened, atol=1e-4, rtol=0)
    assert abs(perplexity(kept) / perplexity(widened) - 1) < 1e-3
