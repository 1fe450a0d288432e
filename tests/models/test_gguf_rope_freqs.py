"""Llama 3.1 / 3.2 / 3.3 GGUF files: llama.cpp's converter writes their ``llama3`` RoPE scaling as
a ``rope_freqs.weight`` tensor of per-frequency divisors (no metadata key), and kvflow reads it
back as the transformers ``rope_scaling`` that gives those divisors. Oracles: the divisors as
``convert_hf_to_gguf.py`` computes them (copied below), transformers' own ``llama3`` RoPE
frequencies for the checkpoint's config.json values, and the tiny transformers model's greedy
tokens and logprobs. Before: every file with the tensor (every Llama 3.1+ GGUF) was refused."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.layers.rotary import compute_inv_freq
from kvflow.models.gguf_config import load_gguf_config
from kvflow.models.gguf_loader import iter_gguf_weights
from tests.models.test_variant_gguf import _generate_matches_hf, _gguf_tensors

gguf = pytest.importorskip("gguf")


def llama_cpp_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float,
                         original: int) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors`` of llama.cpp's convert_hf_to_gguf.py."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _header(path, arch: str, rope_freqs: np.ndarray | None, *, head_dim: int, theta: float,
            tensors: dict[str, np.ndarray] | None = None, blocks: int = 16,
            hidden: int = 2048, heads: int = 32, kv_heads: int = 8, ffn: int = 8192,
            vocab: int = 128256, eps: float = 1e-5, context: int = 131072) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(vocab)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("head_dim,theta,factor", [
    (128, 500000.0, 8.0),  # meta-llama/Llama-3.1-8B-Instruct config.json
    (64, 500000.0, 32.0),  # meta-llama/Llama-3.2-1B-Instruct
    (128, 500000.0, 32.0),  # meta-llama/Llama-3.2-3B-Instruct
])
def test_meta_llama3_divisors_give_the_config_json_scaling(tmp_path, head_dim, theta, factor):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors = llama_cpp_rope_freqs(theta, head_dim, factor, 1.0, 4.0, 8192)
    config = load_gguf_config(_header(tmp_path / "l.gguf", "llama", divisors,
                                      head_dim=head_dim, theta=theta))
    assert config.rope_parameters == {**scaling, "rope_theta": theta}
    hf = LlamaConfig(hidden_size=head_dim * 32, num_attention_heads=32, head_dim=head_dim,
                     max_position_embeddings=131072,
                     rope_parameters={**scaling, "rope_theta": theta})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = compute_inv_freq(head_dim, theta, dict(config.rope_parameters))
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)


def test_other_llama3_values_are_found_from_the_divisors(tmp_path):
    """A scaling with other low / high factors and length: the frequencies kvflow computes from
    what it reads are llama.cpp's ``inv_freq / rope_freqs``."""
    divisors = llama_cpp_rope_freqs(10000.0, 128, 16.0, 2.0, 8.0, 4096)
    config = load_gguf_config(_header(tmp_path / "l.gguf", "llama", divisors, head_dim=128,
                                      theta=10000.0))
    assert config.rope_parameters["rope_type"] == "llama3"
    ours = compute_inv_freq(128, 10000.0, dict(config.rope_parameters))
    llama_cpp = compute_inv_freq(128, 10000.0, None) / torch.from_numpy(divisors)
    torch.testing.assert_close(ours, llama_cpp, rtol=2e-6, atol=0)


def test_tiny_llama3_gguf_generates_as_transformers(tiny_model_factory, tmp_path):
    """The tiny Llama with rope_scaling llama3 (factor 4, original context 64) written as
    llama.cpp writes it: its config comes back and kvflow generates transformers' greedy tokens
    and logprobs; the tensor is not a weight."""
    tiny = tiny_model_factory("llama_rope_llama3")
    cfg = tiny.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    scaling = {k: cfg.rope_parameters[k] for k in ("factor", "low_freq_factor",
                                                    "high_freq_factor",
                                                    "original_max_position_embeddings")}
    theta = cfg.rope_parameters["rope_theta"]
    divisors = llama_cpp_rope_freqs(theta, head_dim, scaling["factor"],
                                    scaling["low_freq_factor"], scaling["high_freq_factor"],
                                    scaling["original_max_position_embeddings"])
    assert 1 < divisors.min() or 1 < divisors.max()  # the file really scales
    path = _header(tmp_path / "tiny.gguf", "llama", divisors, head_dim=head_dim, theta=theta,
                   tensors=_gguf_tensors(tiny.hf_model, "llama"),
                   blocks=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                   ffn=cfg.intermediate_size,
                   vocab=cfg.vocab_size, eps=cfg.rms_norm_eps,
                   context=cfg.max_position_embeddings)
    config = load_gguf_config(path)
    assert config.rope_parameters == {"rope_type": "llama3", **scaling, "rope_theta": theta}
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(path, torch.float32))
    _generate_matches_hf(tiny, path)


def test_divisors_of_one_are_no_scaling(tmp_path):
    config = load_gguf_config(_header(tmp_path / "l.gguf", "llama", np.ones(64, np.float32),
                                      head_dim=128, theta=500000.0))
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}


@pytest.mark.parametrize("arch,divisors,pattern", [
    # not a llama3 curve: refused, never rotated with other frequencies
    ("llama", np.linspace(8.0, 1.0, 64, dtype=np.float32), "no llama3 scaling"),
    ("llama", np.full(32, 2.0, np.float32), "32 RoPE divisors, not one per frequency pair"),
    ("llama", np.full(64, 0.5, np.float32), "must be finite and >= 1"),
    ("qwen2", llama_cpp_rope_freqs(500000.0, 128, 8.0, 1.0, 4.0, 8192),
     "read for dense 'llama' files only"),
])
def test_divisors_kvflow_cannot_apply_are_refused(tmp_path, arch, divisors, pattern):
    path = _header(tmp_path / "edited.gguf", arch, divisors, head_dim=128, theta=500000.0)
    with pytest.raises(ValueError, match=pattern) as info:
        load_gguf_config(path)
    assert "edited.gguf" in str(info.value) and "rope_freqs.weight" in str(info.value)
