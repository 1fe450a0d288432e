"""Image inputs of vision-language models: sources, limits, encoder budget."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvflow.config.options import check_choices, opt

DEFAULT_ENCODER_CACHE_SIZE = 16384
# The image limits' documented defaults, which an unset (None) limit takes.
IMAGE_LIMIT_DEFAULTS: dict[str, int | float] = {
    "max_image_bytes": 20 * 2**20, "max_image_pixels": 4096 * 4096,
    "max_images_per_prompt": 16, "media_fetch_timeout": 10.0}
# Every setting with a fixed documented default: MultiModalConfig.limit is the one place
# they are resolved (max_num_encoder_input_tokens defaults to the step budget, not here).
LIMIT_DEFAULTS: dict[str, int | float] = {
    **IMAGE_LIMIT_DEFAULTS, "encoder_cache_size": DEFAULT_ENCODER_CACHE_SIZE}


@dataclass
class MultiModalConfig:
    """Image inputs of vision-language models: where images may come from, how big they may
    be, and how much vision-encoder work one engine step takes on.

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
    max_image_bytes: int | None = opt(None, "largest encoded image (data URL payload or "
                                       "download) in bytes (default: 20 MiB, 20971520); "
                                       "refused for a text-only model")
    max_image_pixels: int | None = opt(None, "largest image in pixels (width x height), "
                                        "checked before the image is decoded (default: 4096 x "
                                        "4096, 16777216); refused for a text-only model")
    max_images_per_prompt: int | None = opt(None, "most images one prompt or conversation may "
                                             "carry (default: 16); refused for a text-only "
                                             "model")
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
        check_choices(self)
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_prompt",
                     "encoder_cache_size", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.media_fetch_timeout is not None and self.media_fetch_timeout <= 0:
            raise ValueError(f"media_fetch_timeout={self.media_fetch_timeout} must be > 0")
        self.media_domains()  # a malformed list fails at start-up

    def limit(self, name: str) -> int | float:
        """The limit ``name`` in force (``max_image_bytes`` in bytes, ``max_image_pixels`` in
        pixels, ``max_images_per_prompt`` in images, ``media_fetch_timeout`` in seconds,
        ``encoder_cache_size`` in tokens): the value given, else its documented default
        (``LIMIT_DEFAULTS``).

        Raises:
            KeyError: for a name that is not one of those five.
        """
        value = getattr(self, name) if name in LIMIT_DEFAULTS else None
        return LIMIT_DEFAULTS[name] if value is None else value

    def image_options(self) -> list[str]:
        """The image settings given (``name=value``, in field order) that only an engine
        whose model takes images reads: the image URL hosts, the image limits and the vision
        encoder's budget and cache."""
        return [f"{name}={getattr(self, name)!r}" for name in
                ("allowed_media_domains", *IMAGE_LIMIT_DEFAULTS,
                 "max_num_encoder_input_tokens", "encoder_cache_size")
                if getattr(self, name) is not None]

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
