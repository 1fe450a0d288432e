"""Qwen2-VL's pieces against transformers: M-RoPE (layers/mrotary.py), the vision encoder
(models/qwen2_vl_vision.py) and the prompt's M-RoPE position ids (models/qwen2_vl.py)."""

from __future__ import annotations

import torch

from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.layers.mrotary import MRotaryEmbedding
from kvflow.models.qwen2_vl import mrope_input_positions
from kvflow.models.qwen2_vl_vision import Qwen2VisionTransformer
from tests.multimodal.conftest import random_image


def test_mrope_equals_transformers():
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, rope_parameters={
                                   "rope_type": "default", "rope_theta": 1000.0,
                                   "mrope_section": [2, 3, 3]})
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 256, (3, 11), generator=gen)
    q, k = torch.randn(11, 4, 16, generator=gen), torch.randn(11, 2, 16, generator=gen)
    ours = MRotaryEmbedding(16, 256, 1000.0, [2, 3, 3])
    q1, k1 = ours(positions, q, k)
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions.unsqueeze(1))  # [3, 1, T] ids
    q2, k2 = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q1, q2[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k2[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    # text: equal ids on the three axes is plain RoPE
    flat = positions[0]
    torch.testing.assert_close(ours(flat.expand(3, -1), q, k)[0], ours(flat, q, k)[0])


def test_vision_encoder_equals_transformers(tiny_qwen2_vl):
    hf = tiny_qwen2_vl.hf_model
    images = [random_image(100, 150, 1), random_image(60, 60, 2)]
    inputs = tiny_qwen2_vl.processor.image_processor(images=images, return_tensors="pt")
    encoder = Qwen2VisionTransformer(hf.config.vision_config)
    state = {k.removeprefix("model.visual."): v for k, v in hf.state_dict().items()
             if k.startswith("model.visual.")}
    encoder.load_state_dict(state)
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    with torch.no_grad():
        ref = hf.model.get_image_features(inputs["pixel_values"],
                                          inputs["image_grid_thw"]).pooler_output
        ours = encoder(inputs["pixel_values"], grids)
    torch.testing.assert_close(ours, torch.cat(ref), atol=1e-5, rtol=1e-4)


def test_prompt_position_ids_equal_transformers(tiny_qwen2_vl):
    img = tiny_qwen2_vl.image_token_id
    ids = [5, 6, 300] + [img] * 12 + [301, 7, 8, 300] + [img] * 4 + [301, 9]
    features = [MultiModalFeature("image", "a", 3, 12, b"", (0, 0), (1, 6, 8)),
                MultiModalFeature("image", "b", 19, 4, b"", (0, 0), (1, 4, 4))]
    positions, delta = mrope_input_positions(ids, features, 2)
    tokens = torch.tensor([ids])
    ref, ref_delta = tiny_qwen2_vl.hf_model.model.get_rope_index(
        tokens, (tokens == img).int(), torch.tensor([[1, 6, 8], [1, 4, 4]]))
    assert positions.tolist() == ref[:, 0].tolist()
    assert delta == int(ref_delta) == -10  # 12 tokens in 4 positions, 4 in 2: 10 fewer
