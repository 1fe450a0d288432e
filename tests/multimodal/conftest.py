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
from tests.e2e.conftest import _prestart_next_module  # noqa: F401 - a fixture

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video_url' in c %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in c %}{{ c['text'] }}"
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


def saved_tiny_vl(folder: str, model: Any, processor: Any, tokenizer: Any,
                  image_processor: Any, image_token_id: int) -> TinyVL:
    """Save ``model``, ``tokenizer`` and ``image_processor`` into ``folder`` (an HF folder
    kvflow loads) and return them as a :class:`TinyVL`."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return TinyVL(folder, model, processor, tokenizer, image_token_id)


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
    return saved_tiny_vl(folder, model, processor, tokenizer, image_processor,
                         model.config.image_token_id)


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


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    """A tiny random Qwen2.5-VL: 56-pixel windows (2 x 2 merged tokens), one full-attention
    block of two, ``tokens_per_second`` 2 (a video's time ids step by 2 per temporal patch
    at the default 2 frames per second)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )

    folder = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    tokenizer = vision_tokenizer(tiny_tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=tiny_text_config(tokenizer),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3, "window_size": 56,
                       "fullatt_block_indexes": [1], "hidden_act": "silu",
                       "tokens_per_second": 2},
        **vision_token_ids(tokenizer))
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_(model, seed=11)
    return save_tiny_vl(folder, model, tokenizer, Qwen2_5_VLProcessor)


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


# ---- videos (tests/multimodal/test_video_inputs.py, the server's video_url test) ----
def random_video(frames: int, size: int, seed: int) -> np.ndarray:
    """uint8 (frames, size, size, 3) of uniform random pixels."""
    return np.random.default_rng(seed).integers(0, 256, (frames, size, size, 3), np.uint8)


MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)  # OPENAI_CLIP_MEAN
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)  # OPENAI_CLIP_STD


def hf_video_pixels(video: np.ndarray, patch: int = 14, merge: int = 2, tps: int = 2
                    ) -> tuple[torch.Tensor, list[int]]:
    """transformers' ``pixel_values_videos`` rows and ``video_grid_thw`` of an unresized
    video: rescale, CLIP-normalize, pad the frames to a multiple of ``tps`` with the last,
    then ``Qwen2VLVideoProcessor.patchify``'s view + permute."""
    x = (video.astype(np.float32) / 255.0 - MEAN) / STD  # (T, H, W, C)
    x = x.transpose(0, 3, 1, 2)  # (T, C, H, W)
    if pad := -x.shape[0] % tps:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    t, c, h, w = x.shape
    gt, gh, gw = t // tps, h // patch, w // patch
    x = x.reshape(gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return torch.from_numpy(x.reshape(gt * gh * gw, c * tps * patch * patch).copy()), \
        [gt, gh, gw]


def expand(tiny, text: str, items: list[tuple[str, list[int]]], special: bool = True
           ) -> list[int]:
    """The prompt ids with each placeholder repeated t*h*w/4 times (items in prompt order;
    ``special``: the tokenizer's special tokens added, as for a prompt, not a chat)."""
    ids = tiny.tokenizer.encode(text, add_special_tokens=special)
    pads = {"image": tiny.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            "video": tiny.tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    out, it = [], iter(items)
    for t in ids:
        if t in pads.values():
            kind, grid = next(it)
            assert pads[kind] == t
            out.extend([t] * (grid[0] * grid[1] * grid[2] // 4))
        else:
            out.append(t)
    return out


def hf_video_reference(tiny, ids: list[int], max_tokens: int, video: np.ndarray | None = None,
                       image=None, second_per_grid_t: float | None = None
                       ) -> tuple[list[float], list[int]]:
    """transformers' prompt-token logprobs (tokens 1..n-1) and greedy tokens."""
    pads = tiny.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    types = [1 if t == pads[0] else 2 if t == pads[1] else 0 for t in ids]  # text 0
    inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types])}
    if video is not None:
        pixels, grid = hf_video_pixels(video)
        inputs.update(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
        if second_per_grid_t is not None:
            inputs["second_per_grid_ts"] = torch.tensor([second_per_grid_t])
    if image is not None:
        out = tiny.processor.image_processor(images=[image], return_tensors="pt")
        inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    with torch.no_grad():
        logits = tiny.hf_model(**inputs).logits[0]
        gen = tiny.hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                     min_new_tokens=max_tokens, eos_token_id=None,
                                     pad_token_id=0)
    logprobs = torch.log_softmax(logits.float(), -1)
    prompt = [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    return prompt, gen[0, len(ids):].tolist()


def jpeg_frames_url(video: np.ndarray) -> str:
    """vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...`` form (lossless-enough JPEG is
    not needed: the test decodes the same JPEGs for the oracle)."""
    from PIL import Image

    chunks = []
    for frame in video:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=95)
        chunks.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(chunks)


def decoded_jpeg_frames(url: str) -> np.ndarray:
    """The frames of a video/jpeg data URL as PIL decodes them (the oracle's input)."""
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(c))).convert("RGB"))
                     for c in url.split(",", 1)[1].split(",")])


# ---- LLaVA (tests/multimodal/test_llava.py) ----
LLAVA_IMAGE = "<image>"
# llava-hf/llava-1.5-7b-hf's chat template: images first, through a filter, and the
# {% generation %} tag of transformers' Jinja environment
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
LLAVA_IMAGE_SIZE = 56  # 4 x 4 patches of 14 pixels: 16 placeholder tokens ("default")


def _tiny_llava(folder: str, tiny_tokenizer: Any, vision: dict[str, Any], text: dict[str, Any],
                seed: int, **fields: Any) -> TinyVL:
    """A tiny random LlavaForConditionalGeneration saved with a PIL image processor (CLIP's
    for a CLIP tower, SigLIP's otherwise) and the transformers ``LlavaProcessor`` the HF
    side runs."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
            **text}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
              "num_attention_heads": 2, "patch_size": 14, "image_size": LLAVA_IMAGE_SIZE,
              **vision}
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE),
                         **fields)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_(model, seed=seed)
    clip = vision["model_type"] == "clip_vision_model"
    if clip:
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": LLAVA_IMAGE_SIZE},
            crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
    else:
        image_processor = SiglipImageProcessorPil(
            size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=14, chat_template=LLAVA_CHAT_TEMPLATE,
                               vision_feature_select_strategy=config.vision_feature_select_strategy,
                               num_additional_image_tokens=int(clip))
    return saved_tiny_vl(folder, model, processor, tokenizer, image_processor,
                         config.image_token_index)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    """LLaVA-1.5's shape: a CLIP tower (quick_gelu, class token) read at layer -2 without the
    class token ("default"), a gelu projector with biases, a Llama decoder."""
    return _tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")), tiny_tokenizer,
                       {"model_type": "clip_vision_model", "hidden_act": "quick_gelu"},
                       {"model_type": "llama"}, seed=13)


@pytest.fixture(scope="session")
def tiny_llava_siglip(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    """The other shapes: a SigLIP tower read at layer 1 with every token ("full"), a
    projector without biases, a Mistral decoder (sliding window 8)."""
    return _tiny_llava(str(tmp_path_factory.mktemp("tiny_llava_siglip")), tiny_tokenizer,
                       {"model_type": "siglip_vision_model",
                        "hidden_act": "gelu_pytorch_tanh"},
                       {"model_type": "mistral", "sliding_window": 8}, seed=17,
                       vision_feature_layer=1, vision_feature_select_strategy="full",
                       multimodal_projector_bias=False, projector_hidden_act="gelu")


@pytest.fixture(scope="session")
def local_media_dir(tmp_path_factory) -> Any:
    """An empty folder ``allowed`` (with an empty sibling ``outside``) that the shared
    ``qwen2_vl_server`` reads ``file://`` URLs under (tests/multimodal/test_local_media.py
    fills both)."""
    base = tmp_path_factory.mktemp("local_media")
    (base / "allowed").mkdir()
    (base / "outside").mkdir()
    return base / "allowed"


QWEN2_VL_SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256",
                        "--block-size", "16", "--max-image-bytes", "300000"]


def qwen2_vl_server_declaration(fixture: Any) -> tuple[str, list[str], None]:
    """(model, args, env) of the shared ``qwen2_vl_server``, ``fixture(name)`` giving a
    session fixture's value (a ``prestart_servers`` entry: test_local_media.py, which uses it
    first, has it started ahead)."""
    return (fixture("tiny_qwen2_vl").path,
            [*QWEN2_VL_SERVER_ARGS, "--allowed-local-media-path",
             str(fixture("local_media_dir"))], None)


@pytest.fixture(scope="session")
def qwen2_vl_server(start_server, request) -> Any:
    """One ``kvflow serve`` of ``tiny_qwen2_vl`` (``QWEN2_VL_SERVER_ARGS`` plus
    ``--allowed-local-media-path local_media_dir``) for test_qwen2_vl_server.py and
    test_local_media.py (each start takes seconds; ``start_server.shared``, which stops it at
    the end of the session)."""
    model, args, env = qwen2_vl_server_declaration(request.getfixturevalue)
    return start_server.shared(model, args, env)
