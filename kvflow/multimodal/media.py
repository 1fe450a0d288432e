"""Images from request fields: data URLs, allow-listed http(s) URLs and PIL images, checked.

Every refusal is a ``MediaError`` (a ValueError) that says what is wrong with the image and
which limit it broke, so the server answers 400 with it and the offline API raises it:

* a data URL must be ``data:image/<png|jpeg|webp|gif|bmp>;base64,<payload>`` with valid base64;
* a ``file://`` URL is read only when ``--allowed-local-media-path DIR`` is set, and only if
  the file's resolved path (symlinks and ``..`` followed) lies inside DIR;
* an http(s) URL is fetched only from a host named in ``--allowed-media-domains`` (exact host
  match; redirects to other hosts are refused), within ``--media-fetch-timeout`` (the whole
  download, not each read);
* the encoded image may hold at most ``--max-image-bytes``; its width x height, read from
  the header before any pixel is decoded, at most ``--max-image-pixels``;
* it must decode completely (a truncated file is refused, never padded) in one of the formats
  above.

Decoded as transformers decodes: an encoded image is turned upright by its EXIF orientation
(``transformers.image_utils.load_image``, as browsers show a phone photo), and transparency is
composited onto white (the image processors' ``convert_to_rgb``) rather than dropped.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request

from PIL import Image, ImageOps, UnidentifiedImageError

from kvflow.config import MultiModalConfig

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF",
                 "bmp": "BMP"}
_DATA_URL = re.compile(r"([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)  # after "data:"


class MediaError(ValueError):
    """An image that cannot be used: undecodable, of an unsupported type, too large, or from
    a source the server does not fetch from. ``param`` names the request field when known
    (``messages.0.content.1.image_url``); ``image_index`` is the image's place in the
    prompt's image list when the refusal came from preprocessing; ``code`` is the OpenAI
    error code the server answers with."""

    param: str | None = None
    image_index: int | None = None
    code = "invalid_image"


def load_image_url(url: str, config: MultiModalConfig) -> Image.Image:
    """The RGB image a ``data:``, http(s) or ``file://`` URL holds.

    Raises:
        MediaError: for another scheme, a refused host or local path, a failed fetch or
            read, or a bad image (see the module docstring).
    """
    if not isinstance(url, str):
        raise MediaError(f"an image URL must be a string, got {type(url).__name__}")
    url = url.strip()
    scheme = url_scheme(url)
    if scheme == "data":
        return decode_image_bytes(_data_url_bytes(url[5:], config), config)
    if scheme in ("http", "https"):
        return decode_image_bytes(fetch_url(url, config), config)
    if scheme == "file":
        return decode_image_bytes(read_local_file(url, config), config)
    raise MediaError(f"image URLs must be data: URLs (data:image/png;base64,...), http(s) "
                     f"or file:// URLs, got {describe_scheme(url, scheme)}")


def url_scheme(url: str) -> str:
    """A media URL's scheme, lower-cased (schemes are case-insensitive).

    Raises:
        MediaError: for a URL that does not parse (``http://[::1/x``: urllib's bare
            ValueError would name no part).
    """
    try:
        return urllib.parse.urlsplit(url).scheme.lower()
    except ValueError as e:
        raise MediaError(f"malformed URL {url[:64]!r}: {e}") from None


def describe_scheme(url: str, scheme: str) -> str:
    """How a refused media URL is named: ``scheme 'ftp'``, or for a URL without one (a bare
    base64 payload, a relative path) its first 16 characters and "no scheme"."""
    if scheme:
        return f"scheme {scheme!r}"
    return f"{url[:16]!r}... (no scheme: inline data needs the data:<type>;base64, prefix)"


def _data_url_bytes(url: str, config: MultiModalConfig) -> bytes:
    """The payload of a data URL (``url``: what follows ``data:``). Raises MediaError."""
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise MediaError("malformed data URL: expected data:image/png;base64,<payload>")
    media_type, params, payload = match.group(1).strip().lower(), match.group(2), match.group(3)
    subtype = media_type.removeprefix("image/")
    if not media_type.startswith("image/") or subtype not in IMAGE_FORMATS:
        raise MediaError(f"image type {media_type or 'text/plain'!r} is not supported: send "
                         f"one of {', '.join(f'image/{t}' for t in IMAGE_FORMATS)}")
    if ";base64" not in params.lower():
        raise MediaError("data URLs of images must be base64-encoded (data:image/png;base64,...)")
    payload = "".join(payload.split())
    limit = config.limit("max_image_bytes")
    if len(payload) * 3 // 4 > limit + 3:
        raise MediaError(f"the image has about {len(payload) * 3 // 4} bytes; the limit is "
                         f"{limit} bytes (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL's payload is not valid base64: {e}") from None


def fetch_url(url: str, config: MultiModalConfig, kind: str = "image") -> bytes:
    """Download an image (or a video file: ``kind`` ``"video"``, the word the errors use)
    from an allow-listed host (at most ``max_image_bytes``).

    Raises:
        MediaError: if the host is not allowed (remote fetching is off by default), the
            download fails or times out, or the body exceeds the byte limit.
    """
    allowed = config.media_domains()
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:  # urllib would not parse
        raise MediaError(f"{kind} URLs with credentials (user@host) are not fetched")  # alike
    host = (parts.hostname or "").lower()
    if host not in allowed:
        hint = f"allowed hosts: {', '.join(sorted(allowed))}" if allowed else \
            "this server fetches no media URLs; start it with --allowed-media-domains"
        raise MediaError(f"fetching {kind}s from {host!r} is not allowed ({hint}); or send "
                         f"the {kind} inline as a data: URL")
    opener = urllib.request.build_opener(_AllowListRedirects(allowed))
    timeout, limit = config.limit("media_fetch_timeout"), config.limit("max_image_bytes")
    deadline = time.monotonic() + timeout
    try:
        with opener.open(url, timeout=timeout) as response:
            body = _read_until(response, limit + 1, deadline)
    except MediaError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MediaError(f"cannot fetch the {kind} from {url!r}: {e}") from None
    if body is None:
        raise MediaError(f"fetching the {kind} from {url!r} took longer than "
                         f"{timeout} s (--media-fetch-timeout)")
    if len(body) > limit:
        raise MediaError(f"the {kind} at {url!r} exceeds {limit} bytes "
                         "(--max-image-bytes)")
    return body


def read_local_file(url: str, config: MultiModalConfig) -> bytes:
    """The bytes of the file a ``file://`` URL names (at most ``max_image_bytes``), read only
    from inside ``--allowed-local-media-path`` (vLLM's rule: the path with every symlink and
    ``..`` resolved must lie under the directory, itself resolved).

    Raises:
        MediaError: without the flag, for a host other than localhost, a relative path or
            one holding a NUL byte, a path resolving outside the directory, something that
            is not a regular file, a failed read, or more than ``max_image_bytes``.
    """
    root = config.local_media_root()
    if root is None:
        raise MediaError("file:// URLs are refused: this server reads no local files; start "
                         "it with --allowed-local-media-path DIR (allowed_local_media_path) "
                         "to allow the files under DIR, or send the media inline as a data: "
                         "URL")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// URL names a file on this machine; got host "
                         f"{parts.netloc!r} (write file:///path)")
    path = urllib.request.url2pathname(parts.path)
    if "\0" in path:  # realpath / open would raise a bare ValueError, naming no part
        raise MediaError(f"a file:// URL's path cannot hold a NUL byte (%00), got {path!r}")
    if not os.path.isabs(path):
        raise MediaError(f"a file:// URL needs an absolute path, got {path!r}")
    resolved = os.path.realpath(path)
    if not resolved.startswith(str(root).rstrip(os.sep) + os.sep):
        raise MediaError(f"the file {path!r} is not under --allowed-local-media-path {root} "
                         "(its path with symlinks and '..' resolved leads outside it)")
    limit = config.limit("max_image_bytes")
    # O_NOFOLLOW: the resolved path must not have become a symlink since; O_NONBLOCK: a FIFO
    # does not wait for a writer (it is then refused as not a regular file)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        with os.fdopen(os.open(resolved, flags), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise MediaError(f"{path!r} is not a regular file")
            data = f.read(limit + 1)
    except MediaError:
        raise
    except OSError as e:
        raise MediaError(f"cannot read the file {path!r}: {e.strerror or e}") from None
    if len(data) > limit:
        raise MediaError(f"the file {path!r} exceeds {limit} bytes (--max-image-bytes)")
    return data


def _read_until(response, limit: int, deadline: float) -> bytes | None:
    """At most ``limit`` bytes of ``response``, or None once ``time.monotonic()`` passes
    ``deadline`` (the socket timeout bounds each read only: a server sending a byte now and
    then would hold the fetch for as long as it liked)."""
    chunks, size = [], 0
    while size < limit:
        if time.monotonic() > deadline:
            return None
        chunk = response.read1(min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to another allow-listed host."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        """urllib's hook for a 3xx answer.

        Raises:
            MediaError: when the new location is not an allowed media domain.
        """
        host = (urllib.parse.urlsplit(newurl).hostname or "").lower()
        if host not in self.allowed:
            raise MediaError(f"the image URL redirects to {host!r}, which is not an allowed "
                             "media domain")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def decode_image_bytes(data: bytes, config: MultiModalConfig) -> Image.Image:
    """Decode an encoded image completely, as RGB.

    Raises:
        MediaError: for more than ``max_image_bytes``, an unknown or unsupported format, more
            than ``max_image_pixels`` pixels (checked from the header), or a truncated or
            corrupt file.
    """
    limit = config.limit("max_image_bytes")
    if len(data) > limit:
        raise MediaError(f"the image has {len(data)} bytes; the limit is "
                         f"{limit} bytes (--max-image-bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large: {e} (--max-image-pixels is "
                         f"{config.limit('max_image_pixels')})") from None
    except (OSError, ValueError) as e:  # UnidentifiedImageError too
        raise _undecodable(data, e) from None
    if image.format not in IMAGE_FORMATS.values():
        raise MediaError(f"image format {image.format} is not supported: send PNG, JPEG, "
                         "WebP, GIF or BMP")
    return to_rgb(_upright(_loaded(image, config)))


# the file signatures (magic numbers) of the formats read, to tell a truncated or damaged file
# of one of them from bytes that are no image (BMP's two-byte "BM" is too weak to tell)
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"),
               (b"GIF89a", "GIF"))


def _undecodable(data: bytes, error: Exception) -> MediaError:
    """The refusal of encoded image bytes that PIL cannot open (``error``): bytes that begin
    with a PNG, JPEG, GIF or WebP signature are that format's file, truncated or damaged
    (a header-only PNG), other bytes are no image of a format read."""
    found = next((kind for signature, kind in _SIGNATURES if data.startswith(signature)),
                 "WebP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None)
    # UnidentifiedImageError's message names a BytesIO object, nothing useful
    detail = "" if isinstance(error, UnidentifiedImageError) else f": {error}"
    if found is not None:
        return MediaError(f"cannot decode the image: its {len(data)} bytes begin as a {found} "
                          f"file, which is truncated or damaged{detail}")
    if not detail:
        return MediaError(f"cannot decode the image: its {len(data)} bytes are not a PNG, "
                          "JPEG, WebP, GIF or BMP file")
    return MediaError(f"cannot decode the image (not a PNG, JPEG, WebP, GIF or BMP "
                      f"file?){detail}")


def image_format(data: bytes) -> str:
    """The format of encoded image bytes that ``decode_image_bytes`` accepted, as the
    ``image/<subtype>`` of a data URL names it (``png``, ``jpeg``, ``webp``, ``gif``,
    ``bmp``)."""
    with Image.open(io.BytesIO(data)) as image:
        return str(image.format).lower()


def check_image(image: Image.Image, config: MultiModalConfig) -> Image.Image:
    """``image`` (a PIL image handed in by the caller) fully decoded and converted to RGB,
    after the pixel-count check; no EXIF rotation (transformers' image processors apply none
    to a PIL image either).

    Raises:
        MediaError: for more than ``max_image_pixels`` pixels, or pixel data that does not
            decode (truncated or corrupt).
    """
    return to_rgb(_loaded(image, config))


def _loaded(image: Image.Image, config: MultiModalConfig) -> Image.Image:
    """``image`` with its pixels decoded, after the pixel-count check (MediaError)."""
    width, height = image.size
    limit = config.limit("max_image_pixels")
    if width * height > limit:
        raise MediaError(f"the image is {width} x {height} = {width * height} pixels; the "
                         f"limit is {limit} pixels (--max-image-pixels)")
    try:
        image.load()
        return image
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError(f"cannot decode the image (truncated or corrupt): {e}") from None


def _upright(image: Image.Image) -> Image.Image:
    """``image`` rotated / mirrored as its EXIF orientation tag says (transformers'
    ``load_image``); a malformed EXIF block leaves it as stored."""
    try:
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, KeyError, TypeError):
        return image


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy of ``image``; an alpha channel or transparent palette colour is
    composited onto white, as transformers' ``convert_to_rgb`` does (plain ``convert("RGB")``
    would drop it and show transparent pixels' arbitrary colours, often black).

    Raises:
        MediaError: for pixel data that does not convert.
    """
    try:
        if "A" not in image.getbands() and image.info.get("transparency") is None:
            return image.convert("RGB")
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    except (OSError, ValueError) as e:
        raise MediaError(f"cannot convert the image to RGB: {e}") from None
