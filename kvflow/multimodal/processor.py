"""Images + a prompt with one placeholder per image -> the expanded prompt and its features.

The model's own HF image processor (transformers, PIL backend: no torchvision needed) resizes
each image to its dynamic resolution, normalizes it and cuts it into patches; the image then
needs ``t * h * w / merge^2`` placeholder tokens, so the single placeholder token the prompt
holds for it (``<|image_pad|>`` for Qwen2-VL, the config's ``image_token_id``) is repeated that
many times, as vLLM does. Each image becomes a ``MultiModalFeature`` keyed by a hash of its
preprocessed pixels.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from PIL import Image

from kvflow.config import MultiModalConfig
from kvflow.multimodal.media import MediaError, check_image
from kvflow.multimodal_inputs import MultiModalFeature


def load_image_processor(path: str) -> Any:
    """The model folder's image processor (``preprocessor_config.json``), PIL backend.

    Raises:
        ValueError: if the folder has no image processor transformers can load.
    """
    from transformers import AutoImageProcessor

    try:
        try:
            return AutoImageProcessor.from_pretrained(path, backend="pil")
        except TypeError:  # transformers 4.x: no backends; the slow processor uses PIL
            return AutoImageProcessor.from_pretrained(path, use_fast=False)
    except Exception as e:
        raise ValueError(f"cannot load the image processor of {path!r} "
                         f"(preprocessor_config.json): {e}") from e


class VideoNotSupported(ValueError):
    """A prompt holding the video placeholder token: kvflow takes no video."""


class MultiModalProcessor:
    """Expands image placeholders and preprocesses images for one vision-language model.

    Args:
        image_processor: the model's HF image processor (``patch_size``, ``merge_size``).
        hf_config: the model config (``image_token_id``, ``vision_start_token_id`` /
            ``vision_end_token_id`` when the model wraps images in them).
        tokenizer: the model's tokenizer (for the placeholder text), or None.
        config: the image limits.
    """

    def __init__(self, image_processor: Any, hf_config: Any, tokenizer: Any,
                 config: MultiModalConfig) -> None:
        check_geometry(image_processor, hf_config)
        self.image_processor = image_processor
        self.config = config
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 1))
        self.patch_size = int(getattr(image_processor, "patch_size", 1))
        self.placeholder = _placeholder_text(tokenizer, hf_config, self.image_token_id)
        video = getattr(hf_config, "video_token_id", None)  # kvflow takes no video yet
        self.video_token_id = None if video is None else int(video)

    def check_no_video(self, token_ids: list[int]) -> None:
        """Raises ValueError if ``token_ids`` hold the model's video placeholder token (its
        raw embedding, which the model only ever saw replaced by a video's features): kvflow
        takes no video. Used for generation (``process``) and embedding prompts alike.

        Raises:
            VideoNotSupported: (a ValueError) naming the token's id."""
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise VideoNotSupported(f"the prompt holds the video placeholder token (id "
                                    f"{self.video_token_id}): kvflow takes no video; remove "
                                    "the token from the prompt")

    def process(self, token_ids: list[int], images: list[Image.Image]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """Preprocess ``images`` and expand their placeholders in ``token_ids``.

        Returns:
            (the expanded prompt, one feature per image in prompt order).

        Raises:
            ValueError: if the prompt's placeholder count differs from the image count, it
                holds the video placeholder token, or there are more images than
                ``max_images_per_prompt``; ``MediaError`` for an
                image the model cannot take (too small, too elongated, too large).
        """
        self.check_no_video(token_ids)
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        limit = self.config.limit("max_images_per_prompt")
        if len(images) > limit:
            raise ValueError(f"{len(images)} images in one prompt; the limit is {limit} "
                             "(--max-images-per-prompt)")
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholder(s) "
                             f"({self.placeholder!r}) but {len(images)} image(s) were given: "
                             "put exactly one placeholder where each image goes")
        expanded, features, cursor = [], [], 0
        for k, (slot, image) in enumerate(zip(slots, images)):
            try:
                pixels, grid = self.preprocess(image)
            except MediaError as e:
                e.image_index = k
                raise
            expanded.extend(token_ids[cursor:slot])
            length = grid[0] * grid[1] * grid[2] // self.merge ** 2
            features.append(_feature(pixels, grid, len(expanded), length))
            expanded.extend([self.image_token_id] * length)
            cursor = slot + 1
        expanded.extend(token_ids[cursor:])
        return expanded, features

    def preprocess(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image -> (pixel_values float32 [num_patches, patch_dim], (t, h, w) patches).

        Raises:
            MediaError: for something that is not a PIL image, or one the model cannot take.
        """
        if not isinstance(image, Image.Image):
            raise MediaError(f"images must be PIL.Image.Image objects, got "
                             f"{type(image).__name__}")
        width, height = image.size
        if min(width, height) < self.patch_size:
            raise MediaError(f"the image is {width} x {height} pixels; each side must be at "
                             f"least {self.patch_size} pixels (one vision patch)")
        image = check_image(image, self.config)
        try:
            out = self.image_processor(images=[image], return_tensors="np")
        except ValueError as e:  # e.g. an aspect ratio above 200
            raise MediaError(f"the image cannot be preprocessed: {e}") from None
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return np.ascontiguousarray(out["pixel_values"], np.float32), grid


# image processor attribute -> the vision config's name for the same size
_GEOMETRY = {"patch_size": "patch_size", "merge_size": "spatial_merge_size",
             "temporal_patch_size": "temporal_patch_size"}


def check_geometry(image_processor: Any, hf_config: Any) -> None:
    """The image processor cuts patches as the vision encoder reads them.

    Raises:
        ValueError: when ``preprocessor_config.json`` and ``config.json``'s ``vision_config``
            disagree on a patch size or the merge (the placeholder count would not match the
            encoder's rows, and the first image would fail inside the engine).
    """
    vision = getattr(hf_config, "vision_config", None)
    for ours, theirs in _GEOMETRY.items():
        mine = getattr(image_processor, ours, None)
        model = vision.get(theirs) if isinstance(vision, dict) else \
            getattr(vision, theirs, None)
        if mine is not None and model is not None and int(mine) != int(model):
            raise ValueError(f"preprocessor_config.json has {ours}={mine} but config.json's "
                             f"vision_config has {theirs}={model}: the image processor does "
                             "not fit this model")


def _feature(pixels: np.ndarray, grid: tuple[int, int, int], offset: int,
             length: int) -> MultiModalFeature:
    data = pixels.tobytes()
    digest = hashlib.blake2b(np.asarray(grid, np.int64).tobytes() + data, digest_size=16)
    return MultiModalFeature("image", digest.hexdigest(), offset, length, data,
                             (int(pixels.shape[0]), int(pixels.shape[1])), grid)


def _placeholder_text(tokenizer: Any, hf_config: Any, image_token_id: int) -> str:
    """The text that stands for one image in a prompt (Qwen2-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    if tokenizer is None:
        return f"<image token {image_token_id}>"
    ids = [getattr(hf_config, "vision_start_token_id", None), image_token_id,
           getattr(hf_config, "vision_end_token_id", None)]
    return "".join(tokenizer.convert_ids_to_tokens([i for i in ids if i is not None]))
