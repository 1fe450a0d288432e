"""The multimodal half of :class:`kvflow.inputs.processor.InputProcessor`: a prompt's images
and videos through the model's multimodal processor (``kvflow.multimodal``; None for a
text-only model, which refuses them): placeholders expanded and media preprocessed, a
request's ``mm_processor_kwargs`` checked, and a conversation's media loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.inputs.prompts import ProcessedPrompt

if TYPE_CHECKING:
    from kvflow.multimodal.processor import MultiModalProcessor


def attach_media(mm_processor: MultiModalProcessor | None, text: str | None,
                 token_ids: list[int], images: list[Any], videos: Sequence[Any] = (),
                 mm_kwargs: Mapping[str, Any] | None = None) -> ProcessedPrompt:
    """``token_ids`` with one placeholder per image (video) expanded and ``images``
    (PIL) and ``videos`` (frames) preprocessed, the image processor called with
    ``mm_kwargs`` (a request's ``mm_processor_kwargs``) too; any prompt of a
    vision-language model passes here, so a stray placeholder without its image or
    video is refused.

    Raises:
        ValueError: images, videos or ``mm_kwargs`` for a text-only model, ``mm_kwargs``
            the image processor does not take (naming ``mm_processor_kwargs``), a
            placeholder/item count mismatch, more items than a limit allows, or a bad
            image or video (``MediaError``).
    """
    mm_kwargs = checked_mm_kwargs(mm_processor, mm_kwargs)
    if mm_processor is None:
        if images or videos:
            raise ValueError("this model does not take images or videos "
                             "(multi_modal_data)")
        return ProcessedPrompt(text, token_ids)
    token_ids, features = mm_processor.process(token_ids, images, list(videos), mm_kwargs)
    return ProcessedPrompt(text, token_ids, features or None)


def checked_mm_kwargs(mm_processor: MultiModalProcessor | None,
                      mm_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A request's ``mm_processor_kwargs`` checked against the model's image processor
    (:mod:`kvflow.multimodal.processor_kwargs`); None for none.

    Raises:
        ValueError: naming ``mm_processor_kwargs``: for a text-only model, or keys the
            image processor does not take or kvflow refuses.
    """
    if mm_processor is None:
        if mm_kwargs:
            raise ValueError("mm_processor_kwargs is for a vision-language model's image "
                             "processor; this model takes no images or videos")
        return None
    return mm_processor.check_kwargs(mm_kwargs)


def chat_media(mm_processor: MultiModalProcessor | None, messages: list[dict]
               ) -> tuple[list[Any], list[Any]]:
    """(images, videos) of a conversation's ``image_url`` and ``video_url`` parts
    (``kvflow.multimodal.load_chat_media``; none for a text-only model, whose rendering
    refused such parts already).

    Raises:
        MediaError: naming the part, or ``messages`` for a count over its limit.
    """
    if mm_processor is None:
        return [], []
    from kvflow.multimodal import load_chat_media

    return load_chat_media(messages, mm_processor.config)
