"""Qwen2.5-VL (windowed vision encoder) end to end against transformers (fp32, CPU).

A tiny random ``Qwen2_5_VLForConditionalGeneration`` (``tests/multimodal/conftest.py``) with
56-pixel windows (2 x 2 merged tokens) and one full-attention block of two: images of several
sizes give full and partial windows. Oracle: transformers' ``Qwen2_5_VLProcessor`` + ``generate`` on the same weights:
kvflow's expanded prompt ids, the encoder's rows and the greedy tokens for 0, 1 and 2 images
must equal them.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import (
    PLACEHOLDER,
    hf_generate,
    hf_prompt_ids,
    random_image,
)

MAX_TOKENS = 8


def cases():
    """0, 1 and 2 images: 6 x 4 merged tokens (3 x 2 windows, partial), 4 x 7 and 11 x 3."""
    a, b, c = random_image(168, 112, 1), random_image(120, 200, 2), random_image(300, 90, 3)
    return [("the quick brown fox jumps over", []),
            (f"a {PLACEHOLDER} what is this?", [a]),
            (f"{PLACEHOLDER} and {PLACEHOLDER} compare them", [b, c])]


@pytest.fixture(scope="module")
def llm(tiny_qwen2_5_vl):
    return LLM(tiny_qwen2_5_vl.path, dtype="float32", num_kv_blocks=256, block_size=16)


def test_encoder_rows_equal_transformers(llm, tiny_qwen2_5_vl):
    """The windowed ViT + merger over two images at once: transformers' image embeddings."""
    _, images = cases()[2]
    inputs = tiny_qwen2_5_vl.processor(text=[PLACEHOLDER * 2], images=images,
                                       return_tensors="pt")
    with torch.no_grad():
        want = tiny_qwen2_5_vl.hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"])
    want = torch.cat(list(getattr(want, "pooler_output", want)))
    model = llm.engine.core.executor.runner.model
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    sizes = [t * h * w for t, h, w in grids]
    with torch.no_grad():
        got = model.embed_multimodal(list(inputs["pixel_values"].split(sizes)), grids)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-4)


def test_greedy_tokens_equal_transformers(llm, tiny_qwen2_5_vl, assert_no_leaks):
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for (text, images), out in zip(cases(), outs):
        assert out.prompt_token_ids == hf_prompt_ids(tiny_qwen2_5_vl, text, images)
        assert out.outputs[0].token_ids == \
            hf_generate(tiny_qwen2_5_vl, text, images, MAX_TOKENS)
    assert_no_leaks(llm)
