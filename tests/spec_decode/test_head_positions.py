"""An EAGLE head's RoPE table extended to its target's positions (``extend_head_positions``)
keeps the rotation of every position the head's own config covered: raising the head's
``max_position_embeddings`` (as SGLang does, and kvflow did) moved dynamic NTK's original
length and LongRoPE's attention factor, so such a head rotated positions differently from its
checkpoint (YaRN's original length is written into the rope dict by transformers: kept as a
guard). Oracles: the table of the head's untouched config, and HF
transformers' own rotary embedding of that config (YaRN, LongRoPE)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvflow.layers.rope_parameters import rope_max_positions
from kvflow.models.llama import make_rotary_embedding
from kvflow.spec_decode.head_loading import extend_head_positions

HEAD_POSITIONS, TARGET_POSITIONS, HEAD_DIM = 64, 512, 16

SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 2.0},  # original length: max_position_embeddings
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 10 for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + i / 5 for i in range(HEAD_DIM // 2)]},
}


def _head_config(scaling: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                       head_dim=HEAD_DIM, num_hidden_layers=1, intermediate_size=128,
                       vocab_size=100, max_position_embeddings=HEAD_POSITIONS,
                       rope_scaling=dict(scaling), rope_theta=10000.0)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_extension_keeps_the_rotation_of_the_heads_positions(kind):
    head = _head_config(SCALINGS[kind])
    target = LlamaConfig(max_position_embeddings=TARGET_POSITIONS)
    own = make_rotary_embedding(copy.deepcopy(head)).cos_sin_cache
    extend_head_positions(head, target)
    extended = make_rotary_embedding(head).cos_sin_cache
    assert rope_max_positions(head) >= TARGET_POSITIONS
    assert extended.shape[0] >= TARGET_POSITIONS
    covered = rope_max_positions(_head_config(SCALINGS[kind]))
    torch.testing.assert_close(extended[:covered], own[:covered], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_extended_table_equals_transformers_rope_of_the_checkpoint(kind):
    """Positions below the original length (LongRoPE's short factors; all of YaRN's table)
    rotate as HF's rotary embedding of the head's own config does."""
    head = _head_config(SCALINGS[kind])
    rope = LlamaRotaryEmbedding(copy.deepcopy(head))
    n = 32
    positions = torch.arange(n).unsqueeze(0)
    cos, sin = rope(torch.zeros(1, n, HEAD_DIM), positions)
    extend_head_positions(head, LlamaConfig(max_position_embeddings=TARGET_POSITIONS))
    table = make_rotary_embedding(head).cos_sin_cache[:n]
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=1e-5, atol=1e-6)


def test_a_head_covering_the_target_is_left_alone():
    head = _head_config(SCALINGS["yarn"])
    extend_head_positions(head, LlamaConfig(max_position_embeddings=HEAD_POSITIONS))
    assert rope_max_positions(head) == HEAD_POSITIONS * 2 and \
        head.max_position_embeddings == HEAD_POSITIONS
