"""A tiny random-weight Qwen2-VL (fp32) saved as an HF folder, with its HF reference.

The folder holds what a real Qwen2-VL checkpoint holds: config.json (text_config +
vision_config + image token ids), model.safetensors, the tokenizer (the suite's tiny BPE plus
Qwen2-VL's vision special tokens), a Qwen2-VL-style chat template that loops over content
parts, and preprocessor_config.json for transformers' PIL image processor. The HF side of
each test runs transformers' own ``Qwen2VLProcessor`` + ``Qwen2VLForConditionalGeneration``.
"""

from __future__ import annotations

import base64
import copy
import io
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from tests.conftest import _randomize_

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in c %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_PIXELS = 28 * 28 * 256  # a 448 x 448 image is 1024 patches, 256 placeholder tokens


@dataclass
class TinyVL:
    """The saved tiny Qwen2-VL: ``path`` (HF folder), ``hf_model`` and ``processor``
    (transformers), ``tokenizer``, ``image_token_id``."""

    path: str
    hf_model: Any
    processor: Any
    tokenizer: Any
    image_token_id: int


def vision_tokenizer(tiny_tokenizer: Any) -> Any:
    """A copy of the suite's tiny tokenizer with Qwen2-VL's vision tokens and chat template."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_text_config(tokenizer: Any) -> dict[str, Any]:
    """The language half shared by the tiny Qwen2-VL and Qwen2.5-VL (2 layers, hidden 64,
    4 heads / 2 KV heads, M-RoPE sections 2/3/3)."""
    return {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]}}


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """The config fields naming the four vision special tokens' ids."""
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    return {"vision_start_token_id": ids[0], "vision_end_token_id": ids[1],
            "image_token_id": ids[2], "video_token_id": ids[3]}


def tiny_vl_config(tokenizer: Any):
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config=tiny_text_config(tokenizer),
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3},
        **vision_token_ids(tokenizer))
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def save_tiny_vl(folder: str, model: Any, tokenizer: Any, processor_cls: Any) -> TinyVL:
    """Save ``model`` + ``tokenizer`` + a PIL image processor as an HF folder and build the
    transformers processor (``processor_cls``) the HF side of a test runs."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=MAX_PIXELS)
    # The class check looks up the video processor class, which needs torchvision (not
    # installable next to the CPU torch here); the processor itself never touches video.
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class",
                           lambda *args, **kwargs: None):
        processor = processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                                  chat_template=CHAT_TEMPLATE)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return TinyVL(folder, model, processor, tokenizer, model.config.image_token_id)


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    folder = str(tmp_path_factory.mktemp("tiny_qwen2_vl"))
    tokenizer = vision_tokenizer(tiny_tokenizer)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_vl_config(tokenizer)).to(torch.float32).eval()
    _randomize_(model, seed=7)
    with torch.no_grad():  # the merger's LayerNorm too (its name has no "norm")
        model.model.visual.merger.ln_q.weight.add_(1.0)
    return save_tiny_vl(folder, model, tokenizer, Qwen2VLProcessor)


def random_image(width: int, height: int, seed: int):
    """An RGB PIL image of uniform random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image_or_bytes, media_type: str = "image/png") -> str:
    data = image_or_bytes if isinstance(image_or_bytes, bytes) else png_bytes(image_or_bytes)
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def hf_generate(tiny: TinyVL, text: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt text (one placeholder per image)."""
    inputs = tiny.processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = tiny.hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     min_new_tokens=max_new_tokens, eos_token_id=None,
                                     pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_prompt_ids(tiny: TinyVL, text: str, images: list) -> list[int]:
    """transformers' expanded prompt ids."""
    inputs = tiny.processor(text=[text], images=images or None, return_tensors="pt")
    return inputs["input_ids"][0].tolist()
