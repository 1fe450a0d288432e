"""Videos from request fields: in-process frames, data URLs and allow-listed http(s) URLs.

A video reaches the model as a list of RGB frames (``MultiModalProcessor.process`` cuts them
into patches). The forms taken are vLLM's:

* in process (``multi_modal_data={"video": ...}``): a uint8 numpy array ``(T, H, W, 3)`` or a
  list of PIL images; several videos as a list of those;
* ``data:video/jpeg;base64,<frame 1>,<frame 2>,...``: base64 JPEG frames separated by commas
  (decoded with PIL, no video library needed);
* ``data:video/<mp4|webm|...>;base64,<file>``, an http(s) URL (fetched only from
  ``--allowed-media-domains``, as images are) or a ``file://`` URL (read only from inside
  ``--allowed-local-media-path``, as images are): a video file, decoded with PyAV (``pip install
  av``, an optional dependency: without it such a video is a ``MediaError`` naming it), of
  which ``media_io_kwargs`` ``video.num_frames`` frames (default 32) are sampled uniformly.

Every frame passes the image checks (``--max-image-pixels`` per frame, read before decoding);
the encoded video (data URL payload or download) is held to ``--max-image-bytes``. A
``data:video/jpeg`` URL may hold at most ``media_io_kwargs`` ``video.num_frames`` frames
(default 32, counted before any is decoded: small JPEGs of large frames would otherwise decode
to far more memory than their bytes; vLLM keeps the first ``num_frames`` and drops the rest
unread, kvflow refuses rather than drop frames silently). Every
refusal is a ``MediaError`` with ``code`` ``invalid_video``.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image

from kvflow.config import MultiModalConfig
from kvflow.multimodal.media import (
    _DATA_URL,
    MediaError,
    decode_image_bytes,
    describe_scheme,
    fetch_url,
    read_local_file,
    url_scheme,
)

# Qwen2-VL's processors' default frame rate for frames given without one (transformers'
# Qwen2_5_VLProcessor: fps 2.0): a temporal patch of 2 frames then spans 1 s.
DEFAULT_VIDEO_FPS = 2.0


class VideoError(MediaError):
    """A video that cannot be used (see the module docstring)."""

    code = "invalid_video"


class PyAVMissingError(VideoError):
    """A video file to decode without PyAV installed (its message is worded for an API
    client; ``kvflow generate --video`` words its own)."""


def video_list(data: Any) -> list[Any]:
    """``multi_modal_data["video"]`` as a list of videos: one video (an array ``(T, H, W,
    3)`` or a list of PIL images) or a list of videos (arrays or lists of PIL images).

    Raises:
        VideoError: for vLLM's ``(frames, metadata)`` tuple, whose metadata kvflow would not
            read."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], dict):
        raise VideoError("a (frames, metadata) video is not read (kvflow takes frames at 2 per "
                         "second and reads no metadata): pass the frames alone")
    if isinstance(data, np.ndarray):
        return [data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(f, Image.Image)
                                                          for f in data):
        return [data]
    return list(data) if isinstance(data, (list, tuple)) else [data]


def video_frames(video: Any) -> list[Image.Image]:
    """One in-process video as RGB PIL frames.

    Raises:
        VideoError: for something that is not a uint8 array ``(T, H, W, 3)`` with T >= 1 or a
            non-empty list of PIL images.
    """
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 \
                or video.shape[0] < 1:
            raise VideoError(f"a video array must be uint8 of shape (frames, height, width, "
                             f"3) with at least one frame, got {video.dtype} {video.shape}")
        return [Image.fromarray(np.ascontiguousarray(frame), "RGB") for frame in video]
    if isinstance(video, (list, tuple)) and video and \
            all(isinstance(f, Image.Image) for f in video):
        return list(video)
    raise VideoError(f"a video must be a uint8 numpy array (frames, height, width, 3) or a "
                     f"non-empty list of PIL images, got {type(video).__name__}")


def load_video_url(url: Any, config: MultiModalConfig) -> list[Image.Image]:
    """The RGB frames a ``data:``, http(s) or ``file://`` video URL holds (see the module
    docstring).

    Raises:
        VideoError: for another scheme, a refused host or local path, a failed fetch or
            read, a bad payload or frame, or a video file without PyAV installed.
    """
    if not isinstance(url, str):
        raise VideoError(f"a video URL must be a string, got {type(url).__name__}")
    url = url.strip()
    try:
        scheme = url_scheme(url)
        if scheme == "data":
            return _data_url_frames(url[5:], config)
        if scheme in ("http", "https"):
            return decode_video_bytes(fetch_url(url, config, "video"), config)
        if scheme == "file":
            return decode_video_bytes(read_local_file(url, config), config)
    except VideoError:
        raise
    except MediaError as e:  # a fetch or frame refusal: the same words, the video's code
        raise VideoError(str(e)) from None
    raise VideoError(f"video URLs must be data: URLs (data:video/jpeg;base64,... or "
                     f"data:video/mp4;base64,...), http(s) or file:// URLs, got "
                     f"{describe_scheme(url, scheme)}")


def _data_url_frames(url: str, config: MultiModalConfig) -> list[Image.Image]:
    """The frames of a data URL (``url``: what follows ``data:``). Raises MediaError."""
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise VideoError("malformed data URL: expected data:video/<type>;base64,<payload>")
    media_type, params, payload = match.group(1).strip().lower(), match.group(2), match.group(3)
    if not media_type.startswith("video/"):
        raise VideoError(f"a video_url data URL must have a video/ media type, got "
                         f"{media_type or 'text/plain'!r}")
    if ";base64" not in params.lower():
        raise VideoError("data URLs of videos must be base64-encoded "
                         "(data:video/mp4;base64,...)")
    payload = "".join(payload.split())
    limit = config.limit("max_image_bytes")
    if len(payload) * 3 // 4 > limit + 3 * (payload.count(",") + 1):
        raise VideoError(f"the video has about {len(payload) * 3 // 4} bytes; the limit is "
                         f"{limit} bytes (--max-image-bytes)")
    chunks = payload.split(",") if media_type == "video/jpeg" else [payload]
    if len(chunks) > config.video_num_frames():  # before any frame is decoded
        raise VideoError(f"the video has {len(chunks)} JPEG frames; the limit is "
                         f"{config.video_num_frames()} frames per video (--media-io-kwargs "
                         "'{\"video\": {\"num_frames\": N}}')")
    try:
        blobs = [base64.b64decode(chunk, validate=True) for chunk in chunks]
    except (binascii.Error, ValueError) as e:
        raise VideoError(f"the data URL's payload is not valid base64: {e}") from None
    if media_type == "video/jpeg":  # vLLM's form: one base64 JPEG per frame
        frames = []
        for i, blob in enumerate(blobs):
            try:
                frames.append(decode_image_bytes(blob, config))
            except MediaError as e:  # say which frame of how many
                raise VideoError(f"frame {i} of {len(blobs)}: {e}") from None
        return frames
    return decode_video_bytes(blobs[0], config)


def decode_video_bytes(data: bytes, config: MultiModalConfig) -> list[Image.Image]:
    """A video file's frames, ``config.video_num_frames()`` of them sampled uniformly
    (every frame of a shorter video), as RGB PIL images, decoded with PyAV.

    Only the sampled frames are kept as images (at most ``2 * num_frames`` at once): a video
    longer than ``num_frames`` is decoded twice, once to count its frames and once to keep
    those at the sampled indices, so a small file of many large frames (a few MB of a static
    4096 x 4096 scene at hundreds of frames) cannot hold every decoded frame in memory.

    Raises:
        VideoError: without PyAV (:class:`PyAVMissingError`), for more than
            ``max_image_bytes``, frames above ``max_image_pixels`` (from the stream header),
            or a file that does not decode.
    """
    try:
        import av
    except ImportError:
        raise PyAVMissingError("decoding video files needs PyAV, which is not installed on "
                               "this server (pip install av); or send the frames as "
                               "data:video/jpeg;base64,<frame>,<frame>,...") from None
    limit = config.limit("max_image_bytes")
    if len(data) > limit:
        raise VideoError(f"the video has {len(data)} bytes; the limit is {limit} bytes "
                         "(--max-image-bytes)")
    num_frames = config.video_num_frames()
    total, frames = _decode_frames(av, data, config, set(range(num_frames)))
    if total == 0:
        raise VideoError("the video has no frames")
    if total > num_frames:  # a second pass keeps the sampled frames only
        _, frames = _decode_frames(av, data, config,
                                   set(sample_indices(total, num_frames)))
    return [f.convert("RGB") for f in frames]


def _decode_frames(av: Any, data: bytes, config: MultiModalConfig, keep: set[int]
                   ) -> tuple[int, list[Image.Image]]:
    """(the video stream's frame count, its frames at the indices in ``keep`` as PIL
    images), decoding every frame but converting only those kept.

    Raises:
        VideoError: for a file without a video stream, frames above ``max_image_pixels``
            (from the stream header), or a file that does not decode.
    """
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise VideoError("the file holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > config.limit("max_image_pixels"):
                raise VideoError(f"the video's frames are {width} x {height} pixels; the "
                                 f"limit is {config.limit('max_image_pixels')} pixels per "
                                 "frame (--max-image-pixels)")
            total, frames = 0, []
            for frame in container.decode(stream):
                if total in keep:
                    frames.append(frame.to_image())
                total += 1
    except VideoError:
        raise
    except Exception as e:  # noqa: BLE001 - av.error.* and decoder failures: a bad file
        raise VideoError(f"cannot decode the video: {type(e).__name__}: {e}") from None
    return total, frames


def sample_indices(total: int, num_frames: int) -> list[int]:
    """The indices of ``num_frames`` uniformly spaced frames of ``total``,
    ``round(linspace(0, total - 1, num_frames))`` (vLLM's video loaders' rule); all ``total``
    when there are no more than ``num_frames``."""
    if total <= num_frames:
        return list(range(total))
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def frames_to_video_patches(frame_patches: np.ndarray, num_frames: int,
                            temporal_patch_size: int) -> np.ndarray:
    """Per-frame patches -> a video's ``pixel_values_videos`` rows.

    Args:
        frame_patches: float32 [num_frames, N, C, P, P]: each frame's N patches in the image
            processor's (merge-window) order.
        num_frames: frames given (padded here to a multiple of ``temporal_patch_size`` by
            repeating the last, as transformers' video processor does).
        temporal_patch_size: frames per temporal patch.

    Returns:
        float32 [grid_t * N, C * temporal_patch_size * P * P]: temporal patch after temporal
        patch, each the N spatial patches with their ``temporal_patch_size`` frames side by
        side under each channel (transformers' Qwen2-VL ``pixel_values_videos`` layout).
    """
    if pad := -num_frames % temporal_patch_size:
        frame_patches = np.concatenate([frame_patches,
                                        np.repeat(frame_patches[-1:], pad, axis=0)])
    t, n, c, p, _ = frame_patches.shape
    grid_t = t // temporal_patch_size
    video = frame_patches.reshape(grid_t, temporal_patch_size, n, c, p, p)
    video = video.transpose(0, 2, 3, 1, 4, 5)  # (grid_t, N, C, tps, P, P)
    return np.ascontiguousarray(video.reshape(grid_t * n, c * temporal_patch_size * p * p),
                                np.float32)
