"""LLaVA-NeXT's any-resolution ("anyres") image layout: the tile grid an image gets, its
placeholder-token count, and how its tiles' features are packed into those tokens.

LLaVA-NeXT (Liu et al. 2024, "LLaVA-NeXT: Improved reasoning, OCR, and world knowledge";
the ``spatial_unpad`` merge of llava-hf/llava-v1.6-*, as transformers'
``LlavaNextForConditionalGeneration`` and vLLM compute it): the image processor picks from
``image_grid_pinpoints`` the (height, width) resolution that keeps the most of the image with
the least padding (transformers' ``select_best_resolution``), resizes the image into it
keeping its aspect ratio, pads it centered and cuts it into ``rows x cols`` tiles of the
tower's ``image_size``; the whole image squashed to one tile (the base tile) goes first.
Every tile runs through the vision tower and the projector. The base tile's features come
first, as they are; the other tiles' make one feature map of ``rows * h`` x ``cols * w``
patches (``h = w = image_size / patch_size``), cut to the rows or columns that are not
padding (centered, as the processor padded: "unpadding"), with the ``image_newline`` vector
after each row, row-major. An image therefore takes ``h * w + H' * (W' + 1)`` placeholder
tokens, ``H' x W'`` the unpadded map.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.models.clip_vision import VISION_MODEL_TYPES, _field


def check_llava_next_config(config: Any) -> None:
    """Refuse LLaVA-NeXT configs whose tiles kvflow (like transformers and vLLM) cannot pack.

    Raises:
        ValueError: naming the field: ``image_grid_pinpoints`` not a non-empty list of
            (height, width) pairs of positive multiples of ``vision_config.image_size``;
            ``image_size`` not a multiple of ``patch_size``; a
            ``vision_feature_select_strategy`` that leaves a tile with other than
            ``(image_size / patch_size)^2`` features (a CLIP tower needs "default", which
            drops its class token; a SigLIP tower, which has none, needs "full").
    """
    vision = config.vision_config
    tile, patch = int(_field(vision, "image_size")), int(_field(vision, "patch_size"))
    if tile % patch:
        raise ValueError(f"vision_config.image_size={tile} is not a multiple of "
                         f"patch_size={patch}: LLaVA-NeXT tiles must hold whole patches")
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if not isinstance(pinpoints, (list, tuple)) or not pinpoints or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and
            all(isinstance(v, int) and v > 0 and v % tile == 0 for v in p)
            for p in pinpoints):
        raise ValueError(f"image_grid_pinpoints={pinpoints!r}: expected a non-empty list of "
                         f"[height, width] pairs, each a positive multiple of the tile size "
                         f"vision_config.image_size={tile}")
    class_token = VISION_MODEL_TYPES.get(_field(vision, "model_type"), True)
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if (strategy == "default") != class_token:
        need = "default" if class_token else "full"
        raise ValueError(f"vision_feature_select_strategy={strategy!r} with a "
                         f"{_field(vision, 'model_type')} tower leaves a tile with other than "
                         f"(image_size / patch_size)^2 features, which LLaVA-NeXT cannot lay "
                         f"out as a feature map; this tower needs {need!r}")


def anyres_grid(image_size: tuple[int, int], pinpoints: list, tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles for an image of ``image_size`` (height, width) pixels: the
    best of ``pinpoints`` (transformers' ``select_best_resolution``) divided by the ``tile``
    size in pixels."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(tuple(image_size), [tuple(p) for p in pinpoints])
    return height // tile, width // tile


def unpadded_shape(image_size: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """(height, width) in patches of a ``height`` x ``width``-patch feature map cut to the
    part that is not padding, for an image of ``image_size`` (height, width) pixels: the
    padded side loses ``(side - scaled) // 2`` patches at each end (transformers'
    ``unpad_image``, its rounding included)."""
    orig_h, orig_w = image_size
    if orig_w / orig_h > width / height:  # padded above and below
        scaled = int(round(orig_h * (width / orig_w), 7))
        return height - 2 * ((height - scaled) // 2), width
    scaled = int(round(orig_w * (height / orig_h), 7))
    return height, width - 2 * ((width - scaled) // 2)


def _tile_patches(config: Any) -> tuple[int, int]:
    """(tile size in pixels, patches per tile side) of the config's vision tower."""
    tile = int(_field(config.vision_config, "image_size"))
    return tile, tile // int(_field(config.vision_config, "patch_size"))


def llava_next_image_tokens(config: Any, image_size: tuple[int, int]) -> int:
    """Placeholder tokens of one image of ``image_size`` (height, width) pixels: the base
    tile's ``h * w`` plus ``H' * (W' + 1)`` for the unpadded map and its newlines (as
    transformers' ``LlavaNextProcessor`` counts them)."""
    tile, side = _tile_patches(config)
    rows, cols = anyres_grid(image_size, config.image_grid_pinpoints, tile)
    height, width = unpadded_shape(image_size, rows * side, cols * side)
    return side * side + height * (width + 1)


def num_tiles(config: Any, image_size: tuple[int, int]) -> int:
    """Tiles the image processor cuts an image of ``image_size`` (height, width) pixels
    into, the base tile included."""
    rows, cols = anyres_grid(image_size, config.image_grid_pinpoints, _tile_patches(config)[0])
    return rows * cols + 1


def pack_image_features(config: Any, features: torch.Tensor, image_size: tuple[int, int],
                        newline: torch.Tensor) -> torch.Tensor:
    """One image's projected tile features -> its placeholder rows.

    Args:
        config: the LLaVA-NeXT config (``image_grid_pinpoints``, ``vision_config``).
        features: [tiles, h * w, hidden] (any float dtype), the base tile first, the others
            row-major over the grid.
        image_size: the image's (height, width) in pixels before any resize.
        newline: [hidden] the ``image_newline`` vector.

    Returns:
        [llava_next_image_tokens(config, image_size), hidden] in ``features``' dtype.

    Raises:
        ValueError: if the tile count is not the grid's + 1.
    """
    tile, side = _tile_patches(config)
    rows, cols = anyres_grid(image_size, config.image_grid_pinpoints, tile)
    if features.shape[0] != rows * cols + 1:
        raise ValueError(f"{features.shape[0]} tiles for an image of {tuple(image_size)} "
                         f"pixels; image_grid_pinpoints gives {rows} x {cols} + 1")
    dim = features.shape[-1]
    grid = features[1:].reshape(rows, cols, side, side, dim)
    grid = grid.permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, dim)
    height, width = unpadded_shape(image_size, rows * side, cols * side)
    top, left = (rows * side - height) // 2, (cols * side - width) // 2
    grid = grid[top:top + height, left:left + width]
    ends = newline.to(grid.dtype).expand(height, 1, dim)
    return torch.cat([features[0], torch.cat([grid, ends], dim=1).reshape(-1, dim)])
