"""Image inputs on the API side: decoding and checking images (``media.py``) and turning them
into preprocessed features with expanded placeholders (``processor.py``)."""

from __future__ import annotations

from typing import Any

from kvflow.config import MultiModalConfig
from kvflow.multimodal.media import MediaError, load_image_url
from kvflow.multimodal.processor import MultiModalProcessor, load_image_processor

__all__ = ["MediaError", "MultiModalProcessor", "load_image_url", "make_mm_processor"]


def make_mm_processor(source: Any, hf_config: Any, tokenizer: Any,
                      config: MultiModalConfig) -> MultiModalProcessor | None:
    """The processor of a vision-language model (None for a text-only one).

    Raises:
        ValueError: if the model folder has no loadable image processor.
    """
    from kvflow.models.registry import is_multimodal

    if not is_multimodal(hf_config):
        return None
    return MultiModalProcessor(load_image_processor(source.path), hf_config, tokenizer, config)
