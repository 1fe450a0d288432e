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
"""

from __future__ import annotations

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


def processor_kwarg_names(image_processor: Any) -> frozenset[str]:
    """The keyword arguments ``image_processor`` declares for a call (its ``valid_kwargs``
    TypedDict's keys; none for a processor without one, as transformers 4.x's)."""
    valid = getattr(image_processor, "valid_kwargs", None)  # a TypedDict: inherited keys too
    return frozenset(getattr(valid, "__annotations__", None) or ())


def check_mm_processor_kwargs(image_processor: Any,
                              kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``kwargs`` checked against ``image_processor``; None for None or an empty dict.

    Raises:
        ValueError: naming ``mm_processor_kwargs`` and the keys, for something that is not a
            dict, keys the processor does not take, or keys kvflow refuses (``FIXED``).
    """
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{FIELD} must be a dict, got {type(kwargs).__name__}")
    fixed = sorted(set(kwargs) & set(FIXED))
    if fixed:
        raise ValueError(f"{FIELD} {fixed} cannot be changed per request: "
                         f"{FIXED[fixed[0]]}")
    taken = processor_kwarg_names(image_processor)
    unknown = sorted(set(kwargs) - taken)
    if unknown:
        name = type(image_processor).__name__
        accepted = sorted(taken - set(FIXED))
        raise ValueError(f"{FIELD} {unknown} are not taken by this model's image processor "
                         f"({name}), which takes {accepted}" if accepted else
                         f"{FIELD} {unknown} are not taken by this model's image processor "
                         f"({name}), which declares no per-call options")
    return dict(kwargs) or None
