"""Images and videos + a prompt with one placeholder per item -> the expanded prompt and its
features.

The model's own HF image processor (transformers, PIL backend: no torchvision needed) resizes
each image to its dynamic resolution, normalizes it and cuts it into patches; the image then
needs ``t * h * w / merge^2`` placeholder tokens, so the single placeholder token the prompt
holds for it (``<|image_pad|>`` for Qwen2-VL, the config's ``image_token_id``) is repeated that
many times, as vLLM does. A video (``<|video_pad|>``, ``video_token_id``) is cut frame by frame
the same way, its frames grouped ``temporal_patch_size`` to a temporal patch. Each image or
video becomes a ``MultiModalFeature`` keyed by a hash of its preprocessed pixels.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from PIL import Image

from kvflow.config import MultiModalConfig
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.multimodal.media import MediaError, check_image
from kvflow.multimodal.processor_files import (  # noqa: F401 (re-exports: read here before)
    load_image_processor,
    load_video_size,
)
from kvflow.multimodal.processor_kwargs import (
    RESIZE_KEYS,
    check_mm_processor_kwargs,
    image_call_kwargs,
    pixel_bounds_as_size,
)
from kvflow.multimodal.video import (
    DEFAULT_VIDEO_FPS,
    VideoError,
    frames_to_video_patches,
    video_frames,
)


class VideoNotSupported(ValueError):
    """A prompt holding the video placeholder token where no video can go (an embedding
    prompt, a ``/v1/completions`` prompt)."""


class MultiModalProcessor:
    """Expands image and video placeholders and preprocesses images and videos for one
    vision-language model.

    Args:
        image_processor: the model's HF image processor (``patch_size``, ``merge_size``,
            ``temporal_patch_size``); videos are cut frame by frame with it.
        hf_config: the model config (``image_token_id``, ``video_token_id``,
            ``vision_start_token_id`` / ``vision_end_token_id`` when the model wraps images
            in them).
        tokenizer: the model's tokenizer (for the placeholder text), or None.
        config: the image and video limits.
        video_size: the ``size`` (``shortest_edge`` / ``longest_edge`` pixels) video frames
            are resized within (``video_preprocessor_config.json``'s); None: the image
            processor's own.
    """

    def __init__(self, image_processor: Any, hf_config: Any, tokenizer: Any,
                 config: MultiModalConfig, video_size: dict[str, int] | None = None) -> None:
        check_geometry(image_processor, hf_config)
        self.image_processor = image_processor
        self.config = config
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 1))
        # a fixed-size processor (CLIP's, for LLaVA) has no patch size: the encoder's is used
        # to cut its output
        self.patch_size = int(getattr(image_processor, "patch_size", None)
                              or _vision_field(hf_config, "patch_size") or 1)
        self.hf_config = hf_config
        self.token_count = _image_token_count(hf_config)
        self.temporal_patch_size = int(getattr(image_processor, "temporal_patch_size", 1))
        self.placeholder = _placeholder_text(tokenizer, hf_config, self.image_token_id)
        video = getattr(hf_config, "video_token_id", None)
        self.video_token_id = None if video is None else int(video)
        self.video_placeholder = None if video is None else \
            _placeholder_text(tokenizer, hf_config, self.video_token_id)
        self.video_size = video_size

    def check_no_video(self, token_ids: list[int]) -> None:
        """Raises ValueError if ``token_ids`` hold the model's video placeholder token
        where no video can go (an embedding prompt, a completion prompt).

        Raises:
            VideoNotSupported: (a ValueError) naming the token's id."""
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise VideoNotSupported(f"the prompt holds the video placeholder token (id "
                                    f"{self.video_token_id}), but this input takes no video; "
                                    "remove the token from the prompt")

    def check_kwargs(self, kwargs: Any) -> dict[str, Any] | None:
        """A request's ``mm_processor_kwargs`` checked against the image processor (see
        :mod:`kvflow.multimodal.processor_kwargs`); None for none.

        Raises:
            ValueError: naming ``mm_processor_kwargs`` and the keys refused.
        """
        return check_mm_processor_kwargs(self.image_processor, kwargs,
                                         int(self.config.limit("max_image_pixels")),
                                         takes_videos=self.video_token_id is not None)

    def process(self, token_ids: list[int], images: list[Image.Image],
                videos: list[Any] = (), mm_kwargs: dict[str, Any] | None = None
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """Preprocess ``images`` and ``videos`` (each a list of PIL frames, or a form
        ``video.video_frames`` takes) and expand their placeholders in ``token_ids``;
        ``mm_kwargs`` (checked by :meth:`check_kwargs`) go to the image processor's call for
        every image and video frame (resize keys replace a video's own bounds).

        Returns:
            (the expanded prompt, one feature per image or video in prompt order).

        Raises:
            ValueError: if the prompt's placeholder count of either kind differs from the
                image / video count, or there are more images than
                ``max_images_per_prompt`` (videos than ``max_videos_per_prompt``);
                ``MediaError`` for an image or video the model cannot take (no pixels, too
                elongated, too large).
        """
        self._check_counts(token_ids, len(images), len(videos))
        items = {self.image_token_id: iter(images), self.video_token_id: iter(videos)}
        indices = {self.image_token_id: 0, self.video_token_id: 0}
        expanded, features = [], []
        for token in token_ids:
            if token not in items:
                expanded.append(token)
                continue
            k = indices[token]
            indices[token] += 1
            feature = self._feature(next(items[token]), token == self.video_token_id, k,
                                    len(expanded), mm_kwargs)
            features.append(feature)
            expanded.extend([token] * feature.length)
        return expanded, features

    def _check_counts(self, token_ids: list[int], num_images: int, num_videos: int) -> None:
        """Raises ValueError for more items than a limit allows or a placeholder count that
        differs from the item count (images first), or videos for a model without a video
        placeholder (LLaVA)."""
        if num_videos and self.video_token_id is None:
            raise ValueError(f"{num_videos} video(s) given, but this model takes images only "
                             "(its config has no video_token_id); remove "
                             "multi_modal_data['video']")
        for count, token, name, field, text in (
                (num_images, self.image_token_id, "image", "max_images_per_prompt",
                 self.placeholder),
                (num_videos, self.video_token_id, "video", "max_videos_per_prompt",
                 self.video_placeholder)):
            limit = self.config.limit(field)
            if count > limit:
                raise ValueError(f"{count} {name}s in one prompt; the limit is {limit} "
                                 f"(--{field.replace('_', '-')})")
            slots = sum(1 for t in token_ids if t == token) if token is not None else 0
            if slots != count:
                raise ValueError(f"the prompt has {slots} {name} placeholder(s) ({text!r}) "
                                 f"but {count} {name}(s) were given: put exactly one "
                                 f"placeholder where each {name} goes")

    def _feature(self, item: Any, is_video: bool, index: int, offset: int,
                 mm_kwargs: dict[str, Any] | None = None) -> MultiModalFeature:
        """One image's (video's) feature, its placeholders starting at ``offset``; a
        ``MediaError`` carries the item's index among its kind."""
        image_size = None  # the original (height, width), where the model needs it
        try:
            if is_video:
                pixels, grid = self.preprocess_video(item, mm_kwargs)
            else:
                pixels, grid, image_size = self.preprocess(item, mm_kwargs=mm_kwargs)
        except MediaError as e:
            if is_video and not isinstance(e, VideoError):  # a frame's refusal
                e = VideoError(f"a frame of the video: {e}")
            e.image_index = index
            raise e from None
        length = grid[0] * grid[1] * grid[2] // self.merge ** 2
        if self.token_count is not None:
            length = self.token_count(self.hf_config, grid, image_size)
        if not is_video:
            return _feature("image", pixels, grid, offset, length, image_size=image_size)
        fps = (mm_kwargs or {}).get("fps", DEFAULT_VIDEO_FPS)  # the frames' rate
        return _feature("video", pixels, grid, offset, length,
                        self.temporal_patch_size / fps)

    def preprocess(self, image: Any, size: dict[str, int] | None = None,
                   mm_kwargs: dict[str, Any] | None = None
                   ) -> tuple[np.ndarray, tuple[int, int, int], tuple[int, int] | None]:
        """One image -> (pixel_values float32 [num_patches, patch_dim], (t, h, w) patches,
        the original (height, width) pixels where the model needs them: LLaVA-NeXT, whose
        (t, h, w) are (tiles, patches per tile side)); ``size``: resize bounds other than the
        image processor's (video frames); ``mm_kwargs``: a request's
        ``mm_processor_kwargs``, passed to the image processor's call.

        Raises:
            MediaError: for something that is not a PIL image, or one the model cannot take.
        """
        if not isinstance(image, Image.Image):
            raise MediaError(f"images must be PIL.Image.Image objects, got "
                             f"{type(image).__name__}")
        width, height = image.size
        if min(width, height) < 1:  # the processors would divide by zero
            raise MediaError(f"the image is {width} x {height} pixels: it has no pixels")
        image = check_image(image, self.config)
        kwargs = {} if size is None else {"size": size}
        kwargs = pixel_bounds_as_size(self.image_processor,
                                      {**kwargs, **image_call_kwargs(mm_kwargs)})
        try:
            out = self.image_processor(images=[image], return_tensors="np", **kwargs)
        except ValueError as e:  # e.g. an aspect ratio above 200
            raise MediaError(f"the image cannot be preprocessed: {e}") from None
        except (TypeError, KeyError, AttributeError) as e:  # a bad mm_processor_kwargs value
            if not mm_kwargs:
                raise
            raise MediaError(f"the image cannot be preprocessed with mm_processor_kwargs "
                             f"{mm_kwargs}: {type(e).__name__}: {e}") from None
        tile = _vision_field(self.hf_config, "image_size")
        if "image_sizes" in out:  # any-resolution tiles [1, tiles, channels, H, W]
            rows, grids = zip(*(patch_rows(np.asarray(t, np.float32), self.patch_size, tile)
                                for t in out["pixel_values"][0]))
            return np.concatenate(rows), (len(rows), *grids[0][1:]), \
                tuple(int(v) for v in out["image_sizes"][0])
        if "image_grid_thw" not in out:  # one fixed-size image [1, channels, H, W]
            return *patch_rows(np.asarray(out["pixel_values"][0], np.float32),
                               self.patch_size, tile), None
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return np.ascontiguousarray(out["pixel_values"], np.float32), grid, None

    def preprocess_video(self, video: Any, mm_kwargs: dict[str, Any] | None = None
                         ) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One video -> (pixel_values_videos float32 [grid_t * h * w, patch_dim], (grid_t,
        h, w) patches): each frame resized, normalized and cut into patches by the image
        processor (all frames of a video share a size), the frames padded to a multiple of
        ``temporal_patch_size`` by repeating the last and grouped into temporal patches
        (transformers' ``Qwen2VLVideoProcessor`` layout; its torchvision resize may round a
        resized frame's pixels slightly differently from this PIL one). ``mm_kwargs`` go to
        every frame's call; resize keys among them replace the video's own bounds.

        Raises:
            MediaError: for a malformed video, frames of different sizes, or a frame the
                model cannot take.
        """
        frames = video_frames(video)
        if len({f.size for f in frames}) > 1:
            raise VideoError(f"a video's frames must all have one size, got "
                             f"{sorted({f.size for f in frames})}")
        patches, grid = [], None
        size = None if RESIZE_KEYS & set(mm_kwargs or ()) else self.video_size
        for frame in frames:
            pixels, grid, _ = self.preprocess(frame, size, mm_kwargs)
            tps = self.temporal_patch_size
            # the image processor repeats a frame over the temporal patch: keep one copy
            per_frame = pixels.reshape(pixels.shape[0], 3, tps, self.patch_size,
                                       self.patch_size)[:, :, 0]
            patches.append(per_frame)
        rows = frames_to_video_patches(np.stack(patches), len(frames),
                                       self.temporal_patch_size)
        grid_t = -(-len(frames) // self.temporal_patch_size)
        return rows, (grid_t, grid[1], grid[2])


def patch_rows(pixels: np.ndarray, patch: int, image_size: int | None = None
               ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One preprocessed image float32 [channels, H, W] -> (rows float32 [(H / patch) *
    (W / patch), channels * patch^2], (1, H / patch, W / patch)): the patches in row-major
    order, each in (channel, row, column) order (a patch-embedding convolution's weight
    layout).

    Raises:
        MediaError: if H or W is not a multiple of ``patch`` or, with ``image_size``, not
            ``image_size`` (the encoder's position embeddings cover that size only: the
            image processor does not fit the model).
    """
    c, height, width = pixels.shape
    if height % patch or width % patch or (image_size and (height, width) !=
                                           (image_size, image_size)):
        expected = f"{image_size} x {image_size}" if image_size else \
            f"a multiple of {patch} per side"
        raise MediaError(f"the image processor made a {width} x {height} image; the vision "
                         f"encoder takes {expected} pixels (preprocessor_config.json does "
                         "not fit config.json's vision_config)")
    h, w = height // patch, width // patch
    rows = pixels.reshape(c, h, patch, w, patch).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(rows.reshape(h * w, c * patch * patch)), (1, h, w)


def _vision_field(hf_config: Any, name: str) -> Any:
    """A field of the model config's ``vision_config`` (an object or a dict); None if
    absent."""
    vision = getattr(hf_config, "vision_config", None)
    return vision.get(name) if isinstance(vision, dict) else getattr(vision, name, None)


def _image_token_count(hf_config: Any) -> Any:
    """The model class's ``image_token_count(hf_config, grid_thw)`` (placeholder tokens of
    one image, LLaVA's); None where an image takes ``t * h * w / merge^2`` (Qwen2-VL)."""
    from kvflow.models.registry import get_model_class

    try:
        model_cls = get_model_class(getattr(hf_config, "architectures", None))
    except ValueError:
        return None
    return getattr(model_cls, "image_token_count", None)


# image processor attribute -> the vision config's name for the same size
_GEOMETRY = {"patch_size": "patch_size", "merge_size": "spatial_merge_size",
             "temporal_patch_size": "temporal_patch_size"}


def check_geometry(image_processor: Any, hf_config: Any) -> None:
    """The image processor cuts patches as the vision encoder reads them.

    Raises:
        ValueError: when ``preprocessor_config.json`` and ``config.json``'s ``vision_config``
            disagree on a patch size or the merge (the placeholder count would not match the
            encoder's rows, and the first image would fail inside the engine), or on
            LLaVA-NeXT's ``image_grid_pinpoints``.
    """
    _check_grid_pinpoints(image_processor, hf_config)
    vision = getattr(hf_config, "vision_config", None)
    for ours, theirs in _GEOMETRY.items():
        mine = getattr(image_processor, ours, None)
        model = vision.get(theirs) if isinstance(vision, dict) else \
            getattr(vision, theirs, None)
        if mine is not None and model is not None and int(mine) != int(model):
            raise ValueError(f"preprocessor_config.json has {ours}={mine} but config.json's "
                             f"vision_config has {theirs}={model}: the image processor does "
                             "not fit this model")


def _check_grid_pinpoints(image_processor: Any, hf_config: Any) -> None:
    """An any-resolution model (LLaVA-NeXT's ``image_grid_pinpoints``) has an image processor
    tiling by the same resolutions.

    Raises:
        ValueError: when ``preprocessor_config.json`` has no or other pinpoints.
    """
    model = getattr(hf_config, "image_grid_pinpoints", None)
    if model is None:
        return
    mine = getattr(image_processor, "image_grid_pinpoints", None)
    if mine is None or [list(p) for p in mine] != [list(p) for p in model]:
        raise ValueError(f"preprocessor_config.json has image_grid_pinpoints={mine!r} but "
                         f"config.json has {model!r}: the image processor does not tile "
                         "images as this model packs them")


def _feature(modality: str, pixels: np.ndarray, grid: tuple[int, int, int], offset: int,
             length: int, second_per_grid_t: float | None = None,
             image_size: tuple[int, int] | None = None) -> MultiModalFeature:
    """A feature keyed by a digest of its grid, pixels, (videos) seconds per temporal patch
    (the M-RoPE time ids depend on it, so the prefix cache must too) and (LLaVA-NeXT) the
    original image size (its unpadding depends on it)."""
    data = pixels.tobytes()
    key = np.asarray(grid, np.int64).tobytes() + data
    if second_per_grid_t is not None:
        key = b"video" + np.float64(second_per_grid_t).tobytes() + key
    if image_size is not None:
        key = b"size" + np.asarray(image_size, np.int64).tobytes() + key
    digest = hashlib.blake2b(key, digest_size=16)
    return MultiModalFeature(modality, digest.hexdigest(), offset, length, data,
                             (int(pixels.shape[0]), int(pixels.shape[1])), grid,
                             second_per_grid_t, image_size)


def _placeholder_text(tokenizer: Any, hf_config: Any, image_token_id: int) -> str:
    """The text that stands for one image in a prompt (Qwen2-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    if tokenizer is None:
        return f"<image token {image_token_id}>"
    ids = [getattr(hf_config, "vision_start_token_id", None), image_token_id,
           getattr(hf_config, "vision_end_token_id", None)]
    return "".join(tokenizer.convert_ids_to_tokens([i for i in ids if i is not None]))
