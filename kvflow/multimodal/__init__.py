"""Image and video inputs on the API side: decoding and checking images (``media.py``) and
videos (``video.py``) and turning them into preprocessed features with expanded placeholders
(``processor.py``; ``processor_files.py`` reads the model folder's processor configs)."""

from __future__ import annotations

from typing import Any

from kvflow.config import MultiModalConfig
from kvflow.multimodal.media import MediaError, load_image_url
from kvflow.multimodal.processor import MultiModalProcessor, VideoNotSupported
from kvflow.multimodal.processor_files import load_image_processor, load_video_size
from kvflow.multimodal.video import VideoError, load_video_url

__all__ = ["MediaError", "MultiModalProcessor", "VideoNotSupported", "load_chat_media",
           "load_image_url", "load_video_url",
           "make_mm_processor", "mm_processor_of_source"]


def make_mm_processor(source: Any, hf_config: Any, tokenizer: Any,
                      config: MultiModalConfig) -> MultiModalProcessor | None:
    """The processor of a vision-language model (None for a text-only one).

    Raises:
        ValueError: if the model folder has no loadable image processor, or a malformed
            ``video_preprocessor_config.json``.
    """
    from kvflow.models.registry import is_multimodal

    if not is_multimodal(hf_config):
        return None
    return MultiModalProcessor(load_image_processor(source.path), hf_config, tokenizer, config,
                               load_video_size(source.path))


def mm_processor_of_source(source: Any, tokenizer: Any, config: MultiModalConfig,
                           hf_overrides: dict[str, Any] | None = None,
                           trust_remote_code: bool = False) -> MultiModalProcessor | None:
    """The server's image processor for the model at ``source`` (a ``ModelSource``, its
    config.json with ``hf_overrides`` merged in and read with ``trust_remote_code``, as the
    engine core reads it), so that images are decoded, checked and preprocessed in the API
    process (a bad image is a 400
    before anything is queued). None for a GGUF file (kvflow loads no vision-language GGUF),
    a text-only model, or a config that cannot be read (the engine core reports that one).

    Raises:
        ValueError: if a vision-language model's folder has no loadable image processor.
    """
    from kvflow.models.loader import load_hf_config
    from kvflow.models.registry import is_multimodal

    if source.kind == "gguf":
        return None
    try:
        hf_config = load_hf_config(source, hf_overrides=hf_overrides,
                                   trust_remote_code=trust_remote_code)
        if not is_multimodal(hf_config):
            return None
    except ValueError:  # an unreadable config or unknown architecture
        return None
    return make_mm_processor(source, hf_config, tokenizer, config)


def load_chat_media(messages: list[dict], config: MultiModalConfig
                    ) -> tuple[list[Any], list[Any]]:
    """(images, videos) of a conversation's ``image_url`` and ``video_url`` parts, each in
    prompt order, decoded and checked (data URLs; http(s) only from allowed media domains; a
    video as its list of PIL frames).

    Raises:
        MediaError: (a ValueError whose ``param`` names the part) for a bad or refused image
            or video (``VideoError``), or more of them than ``max_images_per_prompt`` /
            ``max_videos_per_prompt`` (checked before anything is decoded; ``param``
            ``messages``).
    """
    from kvflow.chat.messages import image_urls, video_urls

    parts = {"image": (image_urls(messages), load_image_url, MediaError),
             "video": (video_urls(messages), load_video_url, VideoError)}
    for kind, (urls, _, error_cls) in parts.items():
        limit = config.limit(f"max_{kind}s_per_prompt")
        if len(urls) > limit:
            error = error_cls(f"{len(urls)} {kind}s in one conversation; the limit is {limit} "
                              f"(--max-{kind}s-per-prompt)")
            error.param = "messages"
            raise error
    loaded: dict[str, list[Any]] = {kind: [] for kind in parts}
    for kind, (urls, load, _) in parts.items():
        for param, url in urls:
            try:
                loaded[kind].append(load(url, config))
            except MediaError as e:
                e.param = param
                raise
    return loaded["image"], loaded["video"]
