"""One image or video of a prompt, preprocessed (pure data: crosses every process boundary).

The API side (``kvflow/multimodal/``) turns each image or video into a ``MultiModalFeature``:
the model's HF image processor has already resized, normalized and cut it (each frame of a
video) into patches, and the
prompt already holds ``length`` placeholder tokens for it from position ``offset`` on. The
feature then travels with its request, msgspec-encoded, to the engine core (which schedules
the vision encoder and keys the encoder cache and the prefix cache by ``identifier``) and
inside ``NewRequestData`` to the model runners (which run the encoder on ``pixel_values``).

Shipping preprocessed patches rather than encoded image files keeps image decoding, the
size checks and their 400s in the API process, before anything is queued; the core process
only ever sees data that is known to encode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class MultiModalFeature:
    """One image's (or video's) encoder input and where its embeddings go in the prompt.

    Attributes:
        modality: "image" or "video".
        identifier: hex BLAKE2b digest of the preprocessed pixels, grid and (videos)
            ``second_per_grid_t``: equal for equal encoder inputs at equal M-RoPE time steps
            (the encoder-cache key and a prefix-cache extra key).
        offset: position of the first placeholder token in the prompt.
        length: placeholder tokens, equal to the encoder's output rows for this image.
        data: ``pixel_values`` as raw float32 bytes, row-major ``shape``.
        shape: (num_patches, patch_dim) of ``pixel_values``.
        grid_thw: (temporal, height, width) patches before the spatial merge (a video's
            temporal count is its frames / ``temporal_patch_size``).
        second_per_grid_t: a video's seconds per temporal patch (``temporal_patch_size /
            fps``; Qwen2.5-VL spaces its M-RoPE time ids by it); None for an image.
        image_size: the image's (height, width) in pixels before any resize, where the
            model needs it (LLaVA-NeXT: its tile grid and unpadding; ``grid_thw`` is then
            (tiles, h, w) patches per tile); None otherwise.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: bytes
    shape: tuple[int, int]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    image_size: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self.offset + self.length

    def pixel_values(self) -> torch.Tensor:
        """float32 [num_patches, patch_dim], a fresh CPU tensor."""
        array = np.frombuffer(self.data, dtype=np.float32).reshape(self.shape)
        return torch.from_numpy(array.copy())


def overlapping_features(features: list[MultiModalFeature] | None, start: int, end: int
                         ) -> list[MultiModalFeature]:
    """The features whose placeholder ranges overlap token positions ``[start, end)``."""
    return [f for f in features or () if f.offset < end and f.end > start]


def check_mm_features(features: object, num_prompt_tokens: int) -> None:
    """Check images handed over preprocessed (``AsyncLLM.add_request``'s ``mm_features``, a
    ``ProcessedPrompt``, the engine core's queue), not made by the API side's processor:
    features that do not hold what they say would otherwise fail the engine step they are
    encoded in.

    Raises:
        ValueError: naming the feature (``image 1``) and what is wrong: not a list of
            ``MultiModalFeature``, a modality other than image or video, a ``shape`` that is
            not two positive sizes, ``data`` that is not ``shape``'s float32 rows, a
            ``grid_thw`` that is not three positive sizes whose product is the row count,
            placeholders (``offset``, ``length``) outside the prompt's
            ``num_prompt_tokens`` tokens, or placeholders that overlap an earlier feature's.
    """
    if not isinstance(features, (list, tuple)) or \
            not all(isinstance(f, MultiModalFeature) for f in features):
        raise ValueError("mm_features must be a list of MultiModalFeature")
    end = 0
    for i, f in enumerate(features):
        name = f"{f.modality} {i}"
        if f.modality not in ("image", "video"):
            raise ValueError(f"mm_features {i}: modality {f.modality!r} is not image or video")
        shape, grid = tuple(f.shape), tuple(f.grid_thw)
        if not _sizes(shape, 2):
            raise ValueError(f"{name}: shape must be two positive sizes, got {list(shape)}")
        if not isinstance(f.data, bytes) or len(f.data) != shape[0] * shape[1] * 4:
            raise ValueError(f"{name}: data must be {list(shape)} float32 values "
                             f"({shape[0] * shape[1] * 4} bytes), got {len(f.data)} bytes")
        if not _sizes(grid, 3) or int(np.prod(grid)) != shape[0]:
            raise ValueError(f"{name}: grid_thw {list(grid)} must be three positive sizes "
                             f"whose product is its {shape[0]} patch rows")
        if not (isinstance(f.offset, int) and isinstance(f.length, int)
                and f.offset >= end and f.length >= 1 and f.end <= num_prompt_tokens):
            raise ValueError(f"{name}: placeholders [{f.offset}, {f.end}) must lie in the "
                             f"prompt's {num_prompt_tokens} tokens, after the previous "
                             f"feature's (which end at {end})")
        end = f.end


def _sizes(values: tuple, count: int) -> bool:
    """Whether ``values`` are ``count`` positive integers."""
    return len(values) == count and all(isinstance(v, int) and v >= 1 for v in values)
