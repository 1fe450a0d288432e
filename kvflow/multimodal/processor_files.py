"""A vision-language model folder's processor files read: its image processor
(``preprocessor_config.json``, transformers' PIL backend) and its video frames' resize bounds
(``video_preprocessor_config.json``), for :class:`kvflow.multimodal.processor.MultiModalProcessor`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_image_processor", "load_video_size"]


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


def load_video_size(path: str) -> dict[str, int] | None:
    """The resize bounds (``shortest_edge`` / ``longest_edge`` pixels) of the model folder's
    ``video_preprocessor_config.json`` (its ``size``, or ``min_pixels`` / ``max_pixels``);
    None when the folder has none (frames then take the image processor's bounds, as
    transformers' video processor falls back to ``preprocessor_config.json``).

    Raises:
        ValueError: for a file that is not a JSON object or bounds that are not positive
            integers.
    """
    import json
    import os

    file = os.path.join(path, "video_preprocessor_config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            conf = json.load(f)
        size = dict(conf.get("size") or {})
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    for key, name in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if conf.get(key) is not None:
            size[name] = conf[key]
    size = {k: v for k, v in size.items() if k in ("shortest_edge", "longest_edge")}
    if not size:
        return None
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size.values()):
        raise ValueError(f"{file}: size {size} needs shortest_edge and longest_edge, "
                         "positive integers (pixels)")
    return size
