"""GGUF files of Gemma 2, Granite, OLMo 2 and GLM-4-0414, written here from the tiny
transformers models the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (gguf-py's
tensor-name map; Gemma's norm weights stored with the 1 of ``(1 + weight)`` added; Granite's
q/k rows permuted as Llama's, its multipliers as ``granite.{embedding,residual,logit}_scale``
and ``attention.scale``; Gemma 2's caps and window as ``gemma2.*`` keys; GLM-4's rotated
part of a head as ``rope.dimension_count``): kvflow reads back the transformers config and
generates the transformers model's greedy tokens and logprobs (tokenizer from the HF
folder)."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow import LLM
from kvflow.models.gguf_config import load_gguf_config
from tests.models.test_gguf_loader import llama_cpp_permute
from tests.models.test_parity import _prompts, assert_matches_hf, greedy

gguf = pytest.importorskip("gguf")

def _gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for the transformers ``model``'s state dict: names from gguf-py's
    own tensor-name map for the architecture (the table convert_hf_to_gguf.py uses), Gemma
    norms + 1, Llama-layout q/k rows permuted for granite (and llama)."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            array = array + 1.0
        if arch in ("granite", "llama") and ".self_attn.q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch in ("granite", "llama") and ".self_attn.k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = np.ascontiguousarray(array)
    return out


def _write(tiny, path, arch: str, extra_floats: dict[str, float],
           extra_ints: dict[str, int], rope_dim: int | None = None) -> str:
    cfg = tiny.hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dim or head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    for key, value in extra_floats.items():
        w.add_float32(f"{arch}.{key}", value)
    for key, value in extra_ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    for name, array in _gguf_tensors(tiny.hf_model, arch).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _generate_matches_hf(tiny, path) -> None:
    llm = LLM(model=path, tokenizer=tiny.path, dtype="float32", device="cpu",
              num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    for out in llm.generate(_prompts([13, 22], tiny.vocab_size, seed=7), greedy(),
                            use_tqdm=False):
        assert_matches_hf(tiny, out)


def test_granite_gguf(tiny_model_factory, tmp_path):
    tiny = tiny_model_factory("granite")
    cfg = tiny.hf_model.config
    path = _write(tiny, tmp_path / "granite.gguf", "granite", {
        "embedding_scale": cfg.embedding_multiplier, "residual_scale": cfg.residual_multiplier,
        "logit_scale": cfg.logits_scaling, "attention.scale": cfg.attention_multiplier}, {})
    got = load_gguf_config(path)
    assert got.architectures == ["GraniteForCausalLM"]
    for field in ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                  "attention_multiplier"):
        assert getattr(got, field) == pytest.approx(getattr(cfg, field)), field
    _generate_matches_hf(tiny, path)


def test_granite_gguf_without_attention_scale_uses_head_dim(tiny_model_factory, tmp_path):
    """llama.cpp scales by head_dim ** -0.5 when ``granite.attention.scale`` is absent."""
    path = _write(tiny_model_factory("granite"), tmp_path / "g.gguf", "granite", {}, {})
    assert load_gguf_config(path).attention_multiplier == pytest.approx(16 ** -0.5)


def test_gemma2_gguf(tiny_model_factory, tmp_path):
    tiny = tiny_model_factory("gemma2_gguf")
    cfg = tiny.hf_model.config
    path = _write(tiny, tmp_path / "gemma2.gguf", "gemma2", {
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping},
        {"attention.sliding_window": cfg.sliding_window})
    got = load_gguf_config(path)
    assert got.architectures == ["Gemma2ForCausalLM"]
    assert (got.attn_logit_softcapping, got.final_logit_softcapping, got.sliding_window,
            got.query_pre_attn_scalar, got.layer_types) == (
        2.0, 30.0, 8, 16, ["sliding_attention", "full_attention"])
    _generate_matches_hf(tiny, path)


def test_gemma2_gguf_without_caps_has_none(tiny_model_factory, tmp_path):
    """No cap keys: llama.cpp applies no cap; transformers' Gemma2Config defaults (50, 30)
    must not creep in."""
    path = _write(tiny_model_factory("gemma2_gguf"), tmp_path / "g.gguf", "gemma2", {}, {})
    got = load_gguf_config(path)
    assert (got.attn_logit_softcapping, got.final_logit_softcapping) == (None, None)


def test_olmo2_gguf(tiny_model_factory, tmp_path):
    """No attn_norm / ffn_norm; post_attention_norm / post_ffw_norm after attention and
    MLP; attn_q_norm / attn_k_norm over whole projections; biases on all four."""
    tiny = tiny_model_factory("olmo2")
    path = _write(tiny, tmp_path / "olmo2.gguf", "olmo2", {}, {})
    got = load_gguf_config(path)
    assert (got.architectures, got.attention_bias) == (["Olmo2ForCausalLM"], True)
    _generate_matches_hf(tiny, path)


def test_glm4_gguf(tiny_model_factory, tmp_path):
    """ffn_up holds gate and up fused; rope.dimension_count is the rotated quarter of each
    head (4 of 16), read back as partial_rotary_factor."""
    tiny = tiny_model_factory("glm4")
    path = _write(tiny, tmp_path / "glm4.gguf", "glm4", {}, {}, rope_dim=4)
    got = load_gguf_config(path)
    assert got.architectures == ["Glm4ForCausalLM"]
    assert got.rope_parameters["partial_rotary_factor"] == 0.25
    _generate_matches_hf(tiny, path)


def test_partial_rotary_gguf_of_other_architectures_still_refused(tiny_model_factory,
                                                                   tmp_path):
    path = _write(tiny_model_factory("olmo2"), tmp_path / "o.gguf", "olmo2", {}, {},
                  rope_dim=8)
    with pytest.raises(ValueError, match=r"'olmo2.rope.dimension_count' is 8, but the head "
                                         r"size is 16: partial rotary"):
        load_gguf_config(path)


def test_granite_scales_on_llama_gguf_still_refused(tiny_model_factory, tmp_path):
    """Only Granite reads the scales: a ``llama`` GGUF with one is refused naming the key."""
    path = _write(tiny_model_factory("granite"), tmp_path / "llama.gguf", "llama",
                  {"residual_scale": 0.6}, {})
    with pytest.raises(ValueError, match=r"'llama.residual_scale' is 0.6"):
        load_gguf_config(path)
