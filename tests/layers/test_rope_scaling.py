"""YaRN and dynamic-NTK RoPE tables against transformers' own rotary embedding (the oracle),
at positions inside and beyond the original context.

kvflow's table row ``p`` holds ``cos(p f) * a`` then ``sin(p f) * a`` for the rotated pairs;
transformers' ``LlamaRotaryEmbedding(x, position_ids)`` returns ``cos``/``sin`` of
``cat(freqs, freqs)`` already times its ``attention_scaling`` ``a``.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvflow.layers.rope_parameters import rope_max_positions, rope_positions_source
from kvflow.layers.rotary import yarn_attention_factor
from kvflow.models.llama import make_rotary_embedding

ATOL = 2e-5


def _config(max_positions: int, rope_scaling: dict, head_dim: int = 64,
            theta: float = 10000.0, **extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=max_positions, rope_theta=theta,
                       rope_scaling=dict(rope_scaling), **extra)


def _hf_cos_sin(config: LlamaConfig, position_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """cos, sin [len(position_ids), head_dim // 2] from a fresh transformers rotary module
    (fresh: dynamic NTK keeps state between calls), in one forward pass."""
    rope = LlamaRotaryEmbedding(config)
    head_dim = config.hidden_size // config.num_attention_heads
    x = torch.zeros(1, len(position_ids), head_dim)
    cos, sin = rope(x, torch.tensor([position_ids]))
    return cos[0, :, :head_dim // 2], sin[0, :, :head_dim // 2]


def _ours(config: LlamaConfig, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    table = make_rotary_embedding(config).cos_sin_cache[positions]
    return table.chunk(2, dim=-1)


YARN_CASES = {
    # Qwen2.5-style: defaults for betas, truncation and the attention factor
    "qwen25": (2048, {"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 512}, 128, 1e6),
    "betas_no_truncate": (1024, {"rope_type": "yarn", "factor": 8.0,
                                 "original_max_position_embeddings": 128, "beta_fast": 16.0,
                                 "beta_slow": 2.0, "truncate": False}, 64, 10000.0),
    # DeepSeek-V2/V3: mscale / mscale_all_dim give the attention factor
    "mscale": (4096, {"rope_type": "yarn", "factor": 40.0,
                      "original_max_position_embeddings": 100, "mscale": 0.707,
                      "mscale_all_dim": 1.0}, 64, 10000.0),
    "attention_factor": (512, {"rope_type": "yarn", "factor": 2.0,
                               "original_max_position_embeddings": 256,
                               "attention_factor": 1.25}, 32, 10000.0),
    # no factor: max_position_embeddings / original
    "implicit_factor": (1024, {"rope_type": "yarn", "factor": None,
                               "original_max_position_embeddings": 256}, 64, 10000.0),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_table_matches_transformers(case):
    max_positions, scaling, head_dim, theta = YARN_CASES[case]
    config = _config(max_positions, scaling, head_dim, theta)
    orig = scaling["original_max_position_embeddings"]
    limit = rope_max_positions(config)
    positions = sorted({0, 1, 7, orig - 1, orig, orig + 1, min(2 * orig + 3, limit - 2),
                        limit - 1})
    cos, sin = _ours(config, positions)
    hf_cos, hf_sin = _hf_cos_sin(config, positions)
    torch.testing.assert_close(cos, hf_cos, atol=ATOL, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=ATOL, rtol=0)


def test_yarn_attention_factor_by_hand():
    """0.1 ln(s) + 1 (paper sec. 3.4); DeepSeek's ratio of two mscales; an explicit value."""
    assert yarn_attention_factor({"factor": 4.0}) == pytest.approx(0.1 * math.log(4) + 1)
    assert yarn_attention_factor({"factor": 1.0}) == 1.0
    ratio = (0.1 * 0.707 * math.log(40) + 1) / (0.1 * math.log(40) + 1)
    assert yarn_attention_factor({"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0}) \
        == pytest.approx(ratio)
    assert yarn_attention_factor({"factor": 4.0, "attention_factor": 1.25}) == 1.25


def test_yarn_dynamic_and_linear_cover_the_scaled_context():
    """The table (and the longest max_model_len) covers original x factor positions, as
    vLLM derives max_model_len; linear scaling too (it covered max_position_embeddings
    only, so a 4k x 4 linearly scaled Llama 2 served 4k where vLLM serves 16k), but for
    Gemma 3, whose max_position_embeddings is the scaled length already (vLLM's exception)."""
    yarn = _config(1024, {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 512})
    dynamic = _config(100, {"rope_type": "dynamic", "factor": 3.0})
    linear = _config(100, {"rope_type": "linear", "factor": 3.0})
    assert rope_max_positions(yarn) == 2048
    assert rope_max_positions(dynamic) == 300
    assert rope_max_positions(linear) == 300
    gemma3 = _config(100, {"rope_type": "linear", "factor": 3.0})
    gemma3.model_type = "gemma3_text"
    assert rope_max_positions(gemma3) == 100
    assert make_rotary_embedding(dynamic).cos_sin_cache.shape == (300, 64)


@pytest.mark.parametrize("max_positions, scaling, limit, source", [
    (1024, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048,
     "original_max_position_embeddings 512 x factor 4.0 of its yarn RoPE scaling"),
    (4096, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 4096,
     "the model's max_position_embeddings"),
    (100, {"rope_type": "dynamic", "factor": 3.0}, 300,
     "max_position_embeddings 100 x factor 3.0 of its dynamic RoPE scaling"),
    (100, {"rope_type": "linear", "factor": 3.0}, 300,
     "max_position_embeddings 100 x factor 3.0 of its linear RoPE scaling"),
    (100, {}, 100, "the model's max_position_embeddings"),
], ids=["yarn", "yarn_below_max_positions", "dynamic", "linear", "none"])
def test_positions_source_names_what_gives_the_limit(max_positions, scaling, limit, source):
    """The words a too-long max_model_len's refusal gives for the limit name the product
    that makes it (hand-computed: 512 x 4 = 2048, 100 x 3 = 300), or the config's own field
    where no scaling stretches it (it said "scaled for yarn / dynamic rope_scaling" for
    every model, a Llama without RoPE scaling included)."""
    config = _config(max_positions, scaling) if scaling else LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=max_positions)
    assert rope_max_positions(config) == limit
    assert rope_positions_source(config) == source


DYNAMIC = _config(64, {"rope_type": "dynamic", "factor": 4.0}, head_dim=32)


@pytest.mark.parametrize("position", [0, 5, 62, 63, 64, 65, 100, 200, 255])
def test_dynamic_row_matches_transformers_decoding_that_position(position):
    """Row p equals what transformers computes for position p when the forward pass is p + 1
    tokens long, which is how its cached generate decodes position p."""
    cos, sin = _ours(DYNAMIC, [position])
    hf_cos, hf_sin = _hf_cos_sin(DYNAMIC, list(range(position + 1)))
    torch.testing.assert_close(cos, hf_cos[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(sin, hf_sin[-1:], atol=ATOL, rtol=0)


def test_dynamic_prompt_within_the_original_context_is_plain_rope():
    prompt = list(range(50))
    cos, sin = _ours(DYNAMIC, prompt)
    hf_cos, hf_sin = _hf_cos_sin(DYNAMIC, prompt)
    torch.testing.assert_close(cos, hf_cos, atol=ATOL, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=ATOL, rtol=0)


def test_dynamic_long_prompt_differs_only_before_its_last_position():
    """The documented limit: a 130-token prompt (original 64) is rotated by transformers with
    base(130) at every position, by kvflow with base(max(p + 1, 64)) per position: the last
    position agrees, earlier ones do not."""
    prompt = list(range(130))
    cos, _ = _ours(DYNAMIC, prompt)
    hf_cos, _ = _hf_cos_sin(DYNAMIC, prompt)
    torch.testing.assert_close(cos[-1], hf_cos[-1], atol=ATOL, rtol=0)
    assert (cos[:-1] - hf_cos[:-1]).abs().max() > 1e-2


@pytest.mark.parametrize("scaling, theta", [
    ({"rope_type": "default"}, 1e6),
    ({"rope_type": "linear", "factor": 4.0}, 10000.0),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, 500000.0),
], ids=["default", "linear", "llama3"])
def test_long_positions_match_transformers(scaling, theta):
    """Default, linear and Llama 3 tables for head_dim 128 at positions up to 8191, to 1e-6:
    transformers (and Meta's reference code) compute the frequencies in float32, and a
    frequency one float32 step away turns into an angle error growing with the position
    (2.4e-4 in cos/sin by position 4000 when they were computed in float64; 1e-3 in the
    logprobs of a 3.5k-token prompt)."""
    config = _config(8192, scaling, head_dim=128, theta=theta)
    positions = [0, 1, 1000, 2047, 4000, 6001, 8191]
    cos, sin = _ours(config, positions)
    hf_cos, hf_sin = _hf_cos_sin(config, positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)
