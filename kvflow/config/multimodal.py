"""Image and video inputs of vision-language models: sources, limits, encoder budget."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.config.options import check_choices, json_object, opt

DEFAULT_ENCODER_CACHE_SIZE = 16384
# The image limits' documented defaults, which an unset (None) limit takes.
IMAGE_LIMIT_DEFAULTS: dict[str, int | float] = {
    "max_image_bytes": 20 * 2**20, "max_image_pixels": 4096 * 4096,
    "max_images_per_prompt": 16, "media_fetch_timeout": 10.0, "max_videos_per_prompt": 1}
# Frames sampled uniformly from a decoded video file (vLLM's VideoMediaIO default)
DEFAULT_VIDEO_NUM_FRAMES = 32
# Every setting with a fixed documented default: MultiModalConfig.limit is the one place
# they are resolved (max_num_encoder_input_tokens defaults to the step budget, not here).
LIMIT_DEFAULTS: dict[str, int | float] = {
    **IMAGE_LIMIT_DEFAULTS, "encoder_cache_size": DEFAULT_ENCODER_CACHE_SIZE}


def _mm_count(name: str, value: Any) -> int:
    """One modality's count in ``limit_mm_per_prompt``: an integer >= 0, or vLLM's
    ``{"count": N}`` form (its other keys, such as width and height, are refused: kvflow does
    not read them).

    Raises:
        ValueError: naming the modality.
    """
    if isinstance(value, dict):
        extra = sorted(set(value) - {"count"})
        if extra:
            raise ValueError(f"limit_mm_per_prompt {name} sets {extra}, which kvflow does not "
                             "read (only count)")
        value = value.get("count")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"limit_mm_per_prompt {name}={value!r} must be an integer >= 0")
    return value


@dataclass
class MultiModalConfig:
    """Image and video inputs of vision-language models: where they may come from, how big
    they may be, and how much vision-encoder work one engine step takes on.

    Unset settings are None (their documented defaults apply: readers take the image limits
    and the encoder cache's size through :meth:`limit`), so a value given for a text-only model, which reads none, can be
    told apart and refused (``kvflow.core.unread_options.check_no_image_settings``).

    Raises:
        ValueError: from the constructor for a limit below 1 or a malformed domain list.
    """

    allowed_media_domains: str | None = opt(
        None, "comma-separated host names image URLs may be fetched from over http(s), e.g. "
        "images.example.com,127.0.0.1 (default: none; only data: URLs and in-process images); "
        "refused for a text-only model")
    allowed_local_media_path: str | None = opt(
        None, "a directory whose files chat image_url and video_url parts may name as "
        "file:// URLs (the resolved path must stay inside it: symlinks and '..' leading out "
        "are refused) (default: none; file:// URLs are refused); only for trusted clients, as "
        "in vLLM; refused for a text-only model")
    max_image_bytes: int | None = opt(None, "largest encoded image (data URL payload or "
                                       "download) in bytes (default: 20 MiB, 20971520); "
                                       "refused for a text-only model")
    max_image_pixels: int | None = opt(None, "largest image in pixels (width x height), "
                                        "checked before the image is decoded (default: 4096 x "
                                        "4096, 16777216); refused for a text-only model")
    max_images_per_prompt: int | None = opt(None, "most images one prompt or conversation may "
                                             "carry (default: 16); refused for a text-only "
                                             "model")
    max_videos_per_prompt: int | None = opt(
        None, "most videos one prompt or conversation may carry (default: 1; 0 refuses "
        "videos); refused for a text-only model")
    limit_mm_per_prompt: str | dict | None = opt(  # noqa: RUF009 (a dict once parsed)
        None, "vLLM's per-modality limits as a JSON object, e.g. '{\"image\": 4, "
        "\"video\": 1}' (or '{\"image\": {\"count\": 4}}'): the image count sets "
        "--max-images-per-prompt, the video count --max-videos-per-prompt (give one of each "
        "pair); an audio count above 0 is refused (kvflow takes no audio), and so is an image "
        "count of 0 (kvflow cannot turn images off)")
    media_io_kwargs: str | dict | None = opt(  # noqa: RUF009 (a dict once parsed)
        None, "vLLM's media decoding options as a JSON object; kvflow reads "
        "'{\"video\": {\"num_frames\": N}}': frames sampled uniformly from a decoded video "
        f"file (default: {DEFAULT_VIDEO_NUM_FRAMES}); any other key is refused")
    media_fetch_timeout: float | None = opt(None, "seconds allowed for fetching one image URL "
                                             "(default: 10); refused for a text-only model")
    max_num_encoder_input_tokens: int | None = opt(
        None, "vision-encoder output tokens computed per engine step (an image that does not "
        "fit waits for the next step; one image always runs alone) (default: "
        "max_num_batched_tokens)")
    encoder_cache_size: int | None = opt(
        None, "image embeddings (in tokens) kept for reuse after the requests that needed them "
        "moved on (the encoder runs once per distinct image while it stays cached) (default: "
        f"{DEFAULT_ENCODER_CACHE_SIZE}); this and --max-num-encoder-input-tokens are refused "
        "for a text-only model")

    def __post_init__(self) -> None:
        self._apply_mm_limits()
        self._check_media_io_kwargs()
        check_choices(self)
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_prompt",
                     "encoder_cache_size", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_videos_per_prompt is not None and self.max_videos_per_prompt < 0:
            raise ValueError(f"max_videos_per_prompt={self.max_videos_per_prompt} must be >= 0")
        if self.media_fetch_timeout is not None and self.media_fetch_timeout <= 0:
            raise ValueError(f"media_fetch_timeout={self.media_fetch_timeout} must be > 0")
        self.media_domains()  # a malformed list fails at start-up
        self.local_media_root()  # so does a missing directory

    def local_media_root(self) -> Path | None:
        """``allowed_local_media_path`` resolved (symlinks followed, absolute), or None when
        unset (file:// URLs refused).

        Raises:
            ValueError: if the path is not an existing directory.
        """
        if self.allowed_local_media_path is None:
            return None
        root = Path(os.path.expanduser(str(self.allowed_local_media_path))).resolve()
        if not root.is_dir():
            raise ValueError(f"allowed_local_media_path={self.allowed_local_media_path!r} is "
                             "not an existing directory")
        return root

    def _apply_mm_limits(self) -> None:
        """``limit_mm_per_prompt`` (JSON text or a dict) parsed, its image count set as
        ``max_images_per_prompt`` and its video count as ``max_videos_per_prompt``.

        Raises:
            ValueError: for text that is not a JSON object, a modality other than image,
                video or audio, an audio count above 0, an image count of 0, a count given
                with its ``max_*_per_prompt`` field too, or image options (width, height)
                kvflow does not read.
        """
        if self.limit_mm_per_prompt is None:
            return
        limits = json_object("limit_mm_per_prompt", self.limit_mm_per_prompt,
                             '{"image": 4, "video": 1}')
        self.limit_mm_per_prompt = limits
        counts = {name: _mm_count(name, value) for name, value in limits.items()}
        for name, count in counts.items():
            if name not in ("image", "video", "audio"):
                raise ValueError(f"limit_mm_per_prompt names {name!r}; kvflow knows image "
                                 "and video (and refuses audio)")
            if name == "audio" and count > 0:
                raise ValueError(f"limit_mm_per_prompt audio={count} is refused: kvflow "
                                 "takes no audio inputs; give audio 0 or leave it out")
        if counts.get("image") == 0:
            raise ValueError("limit_mm_per_prompt image=0 is refused: kvflow cannot turn "
                             "image inputs off for a model that takes them")
        for name, field_name in (("image", "max_images_per_prompt"),
                                 ("video", "max_videos_per_prompt")):
            if counts.get(name) is None:
                continue
            if getattr(self, field_name) is not None:
                raise ValueError(f"limit_mm_per_prompt {name}={counts[name]} and {field_name}="
                                 f"{getattr(self, field_name)} set the same limit: give one")
            setattr(self, field_name, counts[name])

    def _check_media_io_kwargs(self) -> None:
        """``media_io_kwargs`` parsed; only ``{"video": {"num_frames": N >= 1}}`` is read.

        Raises:
            ValueError: for text that is not a JSON object, or any other key.
        """
        kwargs = json_object("media_io_kwargs", self.media_io_kwargs,
                             '{"video": {"num_frames": 16}}')
        if kwargs is None:
            return
        self.media_io_kwargs = kwargs
        other = sorted(set(kwargs) - {"video"})
        video = kwargs.get("video", {})
        if other or not isinstance(video, dict) or set(video) - {"num_frames"}:
            raise ValueError(f"media_io_kwargs={kwargs!r}: kvflow reads only "
                             '{"video": {"num_frames": N}} (images are decoded as RGB with '
                             "the image limits)")
        frames = video.get("num_frames")
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int)
                                   or frames < 1):
            raise ValueError(f"media_io_kwargs video.num_frames={frames!r} must be an "
                             "integer >= 1")

    def video_num_frames(self) -> int:
        """Frames sampled uniformly from a decoded video file (``media_io_kwargs``
        ``video.num_frames``, default ``DEFAULT_VIDEO_NUM_FRAMES``)."""
        video = (self.media_io_kwargs or {}).get("video") or {}
        return int(video.get("num_frames") or DEFAULT_VIDEO_NUM_FRAMES)

    def limit(self, name: str) -> int | float:
        """The limit ``name`` in force (``max_image_bytes`` in bytes, ``max_image_pixels`` in
        pixels, ``max_images_per_prompt`` in images, ``max_videos_per_prompt`` in videos,
        ``media_fetch_timeout`` in seconds,
        ``encoder_cache_size`` in tokens): the value given, else its documented default
        (``LIMIT_DEFAULTS``).

        Raises:
            KeyError: for a name that is not one of those six.
        """
        value = getattr(self, name) if name in LIMIT_DEFAULTS else None
        return LIMIT_DEFAULTS[name] if value is None else value

    def image_options(self) -> list[str]:
        """The image settings given (``name=value``, in field order) that only an engine
        whose model takes images reads: the image URL hosts, the image limits and the vision
        encoder's budget and cache."""
        given = [f"{name}={getattr(self, name)!r}" for name in
                 ("allowed_media_domains", "allowed_local_media_path", *IMAGE_LIMIT_DEFAULTS, "media_io_kwargs",
                  "max_num_encoder_input_tokens", "encoder_cache_size")
                 if getattr(self, name) is not None]
        if self.limit_mm_per_prompt is not None:  # named as given, not as the fields it set
            set_here = [g for g in given if g.startswith(("max_images_per_prompt=",
                                                          "max_videos_per_prompt="))]
            given = [g for g in given if g not in set_here]
            if any(g != "max_videos_per_prompt=0" for g in set_here):  # video 0: no-op
                given.insert(0, f"limit_mm_per_prompt={self.limit_mm_per_prompt!r}")
        return given

    def media_domains(self) -> frozenset[str]:
        """The allowed host names, lower-cased (empty: no remote fetching).

        Raises:
            ValueError: for an entry that is not a plain host name (with a scheme, path or
                port).
        """
        hosts = [h.strip().lower() for h in (self.allowed_media_domains or "").split(",")]
        for host in hosts:
            if host and not re.fullmatch(r"[a-z0-9.-]+", host):
                raise ValueError(f"allowed_media_domains entry {host!r} is not a host name "
                                 "(no scheme, port or path)")
        return frozenset(h for h in hosts if h)
