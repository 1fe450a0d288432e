"""``mm_processor_kwargs`` (vLLM's per-request "overrides for ``processor.__call__``"): the
keyword arguments a request passes to the model's HF image processor for its images and
video frames, e.g. Qwen2-VL's ``{"max_pixels": 200704}`` or ``{"min_pixels": ...}``, which
change how far an image is resized and so how many tokens it takes.

A key is taken when the image processor declares it (its ``valid_kwargs``, transformers 5),
except those that would make its output unusable by the model: the vision encoder's geometry
(``patch_size``, ``temporal_patch_size``, ``merge_size``, fixed by the model's weights) and
the output's form (``return_tensors``, ``data_format``, ``input_data_format``, ``device``,
``image_seq_length``: kvflow reads numpy arrays channels first, one placeholder count per
model). Every other key is refused, naming it (vLLM hands an unknown one to the processor,
which raises).

``fps`` is a video key, taken by a model that takes videos (Qwen2-VL, Qwen2.5-VL) and kept
from the image processor: the frame rate of the video's frames, frames per second (a finite
number > 0; default 2, transformers' Qwen2.5-VL default). Qwen2.5-VL spaces a video's
M-RoPE time ids by its seconds per temporal patch, ``temporal_patch_size / fps``
(transformers' ``second_per_grid_ts``: 4.x's processor computes it from its ``fps`` argument,
5.x's from the video metadata's frame rate); Qwen2-VL ignores it, as transformers does.

Resizing is bounded as images are (``--max-image-pixels``): a request could otherwise make
the processor upscale a small image to any size. ``min_pixels``, and ``size``'s
``shortest_edge``, are pixel counts on processors that take ``min_pixels`` (Qwen2-VL's: the
image is resized to at least that many pixels), so they may not exceed the limit; on other
processors ``size``, ``crop_size`` and ``pad_size`` are side lengths whose resulting area
depends on the image's shape, and are refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

FIELD = "mm_processor_kwargs"
# keys an image processor takes that kvflow refuses: key -> why
FIXED = {name: "the vision encoder's geometry is the model's" for name in
         ("patch_size", "temporal_patch_size", "merge_size")} | \
    {name: "kvflow reads the processor's output in one form" for name in
     ("return_tensors", "data_format", "input_data_format", "device", "image_seq_length")}
# keys that set how far an image is resized (a video's own bounds give way to them)
RESIZE_KEYS = frozenset({"size", "min_pixels", "max_pixels"})
# keys about a whole video, not passed to the image processor's call for its frames
VIDEO_KEYS = frozenset({"fps"})


def processor_kwarg_names(image_processor: Any) -> frozenset[str]:
    """The keyword arguments ``image_processor`` declares for a call (its ``valid_kwargs``
    TypedDict's keys; none for a processor without one, as transformers 4.x's)."""
    valid = getattr(image_processor, "valid_kwargs", None)  # a TypedDict: inherited keys too
    return frozenset(getattr(valid, "__annotations__", None) or ())


def check_mm_processor_kwargs(image_processor: Any, kwargs: Mapping[str, Any] | None,
                              max_pixels: int, takes_videos: bool = False
                              ) -> dict[str, Any] | None:
    """``kwargs`` checked against ``image_processor``, the pixel limit ``max_pixels`` (the
    ``max_image_pixels`` in force) and, for the ``VIDEO_KEYS``, whether the model
    ``takes_videos``; None for None or an empty dict.

    Raises:
        ValueError: naming ``mm_processor_kwargs`` and the keys, for something that is not a
            dict, keys the processor does not take, keys kvflow refuses (``FIXED``), a
            resize beyond ``max_pixels`` (see the module docstring), a video key for a model
            without videos or an ``fps`` that is not a finite number > 0.
    """
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{FIELD} must be a dict, got {type(kwargs).__name__}")
    _check_video_keys(kwargs, takes_videos)
    fixed = sorted(set(kwargs) & set(FIXED))
    if fixed:
        raise ValueError(f"{FIELD} {fixed} cannot be changed per request: "
                         f"{FIXED[fixed[0]]}")
    taken = processor_kwarg_names(image_processor)
    unknown = sorted(set(kwargs) - taken - VIDEO_KEYS)
    if unknown:
        name = type(image_processor).__name__
        accepted = sorted(taken - set(FIXED))
        raise ValueError(f"{FIELD} {unknown} are not taken by this model's image processor "
                         f"({name}), which takes {accepted}" if accepted else
                         f"{FIELD} {unknown} are not taken by this model's image processor "
                         f"({name}), which declares no per-call options")
    _check_resize(kwargs, "min_pixels" in taken, max_pixels)
    return dict(kwargs) or None


def _check_video_keys(kwargs: Mapping[str, Any], takes_videos: bool) -> None:
    """Refuse ``VIDEO_KEYS`` for a model without videos, and an ``fps`` that is not a finite
    number > 0.

    Raises:
        ValueError: naming the key.
    """
    video = sorted(set(kwargs) & VIDEO_KEYS)
    if video and not takes_videos:
        raise ValueError(f"{FIELD} {video} are for videos; this model takes images only")
    fps = kwargs.get("fps")
    if "fps" in kwargs and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                            or not math.isfinite(fps) or fps <= 0):
        raise ValueError(f"{FIELD} fps={fps!r} must be a number > 0 (the video's frames per "
                         "second)")


def image_call_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Checked ``kwargs`` as the image processor's call takes them: without ``VIDEO_KEYS``."""
    return {k: v for k, v in (kwargs or {}).items() if k not in VIDEO_KEYS}


def _check_resize(kwargs: Mapping[str, Any], pixel_counts: bool, max_pixels: int) -> None:
    """Refuse a resize that may exceed ``max_pixels`` (see the module docstring);
    ``pixel_counts``: the processor's sizes are pixel counts (it takes ``min_pixels``).

    Raises:
        ValueError: naming the key.
    """
    if not pixel_counts:
        sized = sorted(set(kwargs) & {"size", "crop_size", "pad_size"})
        if sized:
            raise ValueError(f"{FIELD} {sized} are refused for this model's image processor: "
                             "its sizes are side lengths, which could make an image of any "
                             "number of pixels (--max-image-pixels bounds images)")
        return
    size = kwargs.get("size")
    if size is not None and not isinstance(size, Mapping):
        raise ValueError(f"{FIELD} size must be a dict such as {{\"shortest_edge\": "
                         f"{56 * 56}, \"longest_edge\": {28 * 28 * 1280}}}, got {size!r}")
    for name, value in (("min_pixels", kwargs.get("min_pixels")),
                        ("size.shortest_edge", (size or {}).get("shortest_edge"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{FIELD} {name}={value!r} must be an integer >= 1 (pixels)")
        if value > max_pixels:
            raise ValueError(f"{FIELD} {name}={value} would resize images to more than "
                             f"{max_pixels} pixels, the limit (--max-image-pixels)")


def pixel_bounds_as_size(image_processor: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a call of ``image_processor`` with ``min_pixels`` / ``max_pixels``
    written as the ``size`` transformers 5 wants (``shortest_edge`` / ``longest_edge``, pixel
    counts) over the ``size`` the call would use (the given one, else the processor's own):
    the resize transformers makes of them, without its FutureWarning that passing them to a
    call is deprecated (and, in a later transformers, gone). Other kwargs pass unchanged.
    """
    bounds = {"shortest_edge": kwargs.get("min_pixels"), "longest_edge": kwargs.get("max_pixels")}
    if all(v is None for v in bounds.values()):
        return dict(kwargs)
    size = kwargs.get("size")
    size = getattr(image_processor, "size", None) if size is None else size
    if size is not None and not isinstance(size, Mapping):  # transformers 5's SizeDict
        size = dataclasses.asdict(size) if dataclasses.is_dataclass(size) else {}
    size = {k: v for k, v in (size or {}).items() if v is not None}
    size.update({k: v for k, v in bounds.items() if v is not None})
    rest = {k: v for k, v in kwargs.items() if k not in ("min_pixels", "max_pixels")}
    return {**rest, "size": size}
