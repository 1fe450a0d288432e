"""Image URLs and decoding (``kvflow/multimodal/media.py``): fetched only from allow-listed
hosts, redirects re-checked, the byte cap applied to the download (a local ``http.server`` on a
free loopback port stands in for the image host; the oracle is the PNG's own pixels); EXIF
orientation applied as transformers' ``load_image`` does, transparency composited onto white
(hand-computed blend)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from kvflow.config import MultiModalConfig
from kvflow.multimodal.media import MediaError, check_image, decode_image_bytes, load_image_url
from tests.multimodal.conftest import png_bytes, random_image


def _jpeg_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG")
    return buf.getvalue()


IMAGE = random_image(40, 30, 9)
PNG = png_bytes(IMAGE)
JPEG = _jpeg_bytes(IMAGE)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/slow.png":  # the PNG in ten pieces, 0.3 s apart
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for k in range(10):
                    self.wfile.write(PNG[k * len(PNG) // 10:(k + 1) * len(PNG) // 10])
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:  # the client gave up
                pass
        elif self.path.startswith("/redirect"):
            host = self.path.split("=", 1)[1]
            self.send_response(302)
            self.send_header("Location", f"http://{host}:{self.server.server_port}/cat.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_allowed_host_is_fetched(image_host):
    config = MultiModalConfig(allowed_media_domains="127.0.0.1")
    image = load_image_url(f"http://127.0.0.1:{image_host}/cat.png", config)
    assert np.array_equal(np.asarray(image), np.asarray(IMAGE))


def test_remote_fetching_is_off_by_default(image_host):
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        load_image_url(f"http://127.0.0.1:{image_host}/cat.png", MultiModalConfig())


def test_other_host_and_redirect_to_it_are_refused(image_host):
    config = MultiModalConfig(allowed_media_domains="127.0.0.1")
    with pytest.raises(MediaError, match="'localhost' is not allowed.*127.0.0.1"):
        load_image_url(f"http://localhost:{image_host}/cat.png", config)
    with pytest.raises(MediaError, match="redirects to 'localhost'"):
        load_image_url(f"http://127.0.0.1:{image_host}/redirect?to=localhost", config)
    image = load_image_url(f"http://127.0.0.1:{image_host}/redirect?to=127.0.0.1", config)
    assert image.size == IMAGE.size


def test_download_byte_cap_and_http_errors(image_host):
    small = MultiModalConfig(allowed_media_domains="127.0.0.1", max_image_bytes=len(PNG) - 1)
    with pytest.raises(MediaError, match=f"exceeds {len(PNG) - 1} bytes"):
        load_image_url(f"http://127.0.0.1:{image_host}/cat.png", small)
    config = MultiModalConfig(allowed_media_domains="127.0.0.1")
    with pytest.raises(MediaError, match="cannot fetch.*404"):
        load_image_url(f"http://127.0.0.1:{image_host}/missing.png", config)


def test_fetch_timeout_bounds_the_whole_download(image_host):
    """A host that keeps sending a little at a time (each read well within the timeout) is
    cut off once the download as a whole passes --media-fetch-timeout (it ran 3 s)."""
    config = MultiModalConfig(allowed_media_domains="127.0.0.1", media_fetch_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(MediaError, match="took longer than 0.5 s"):
        load_image_url(f"http://127.0.0.1:{image_host}/slow.png", config)
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("domains", ["http://example.com", "example.com:80", "a.com/x"])
def test_malformed_domain_list_fails_at_start(domains):
    with pytest.raises(ValueError, match="allowed_media_domains"):
        MultiModalConfig(allowed_media_domains=domains)


def _rgba_image() -> Image.Image:
    """40 x 30 RGBA: random colours, alpha 0 on every other column, random elsewhere."""
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (30, 40, 4), dtype=np.uint8)
    pixels[:, ::2, 3] = 0
    return Image.fromarray(pixels, "RGBA")


def test_transparency_is_composited_onto_white():
    """Oracle: alpha blending onto white by hand (what transformers' convert_to_rgb and vLLM
    do); dropping the alpha channel would keep the transparent pixels' colours."""
    image = _rgba_image()
    rgba = np.asarray(image).astype(np.float64)
    alpha = rgba[..., 3:] / 255
    want = rgba[..., :3] * alpha + 255 * (1 - alpha)
    for got in (decode_image_bytes(png_bytes(image), MultiModalConfig()),
                check_image(image, MultiModalConfig())):
        assert got.mode == "RGB"
        assert np.abs(np.asarray(got).astype(np.float64) - want).max() <= 1
        assert (np.asarray(got)[:, ::2] == 255).all()  # fully transparent: white


def test_exif_orientation_is_applied_like_transformers():
    """A JPEG whose EXIF says "rotate 90 degrees clockwise" (orientation 6, a phone photo):
    decoded upright, pixel for pixel what transformers' load_image gives for the same URL."""
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    random_image(40, 30, 4).save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    got = load_image_url(url, MultiModalConfig())
    assert got.size == (30, 40)
    assert np.array_equal(np.asarray(got), np.asarray(load_image(url)))


def test_url_spellings():
    """Schemes are case-insensitive (RFC 3986) and surrounding blanks are not part of a URL:
    ``DATA:`` decodes to the PNG's pixels (it was refused as "scheme 'data'"); a URL with
    credentials is refused naming them (urllib would read its host differently from the
    allow-list check); bytes that are no image say so without an object repr."""
    url = " DATA:image/png;base64," + base64.b64encode(PNG).decode() + "\n"
    assert np.array_equal(np.asarray(load_image_url(url, MultiModalConfig())),
                          np.asarray(IMAGE))
    config = MultiModalConfig(allowed_media_domains="127.0.0.1")
    with pytest.raises(MediaError, match="credentials"):
        load_image_url("http://evil.example@127.0.0.1:1/cat.png", config)
    with pytest.raises(MediaError, match="its 3 bytes are not a PNG") as refused:
        load_image_url("data:image/png;base64,AAAA", config)
    assert "BytesIO" not in str(refused.value)


@pytest.mark.parametrize("data, detail", [
    (PNG[:8], "PNG file, which is truncated or damaged"),  # the signature alone
    (PNG[:16], "PNG file, which is truncated or damaged: Truncated File Read"),  # in IHDR
    (PNG[:33], "PNG file, which is truncated or damaged"),  # IHDR whole, no image data
    (JPEG[:10], "JPEG file, which is truncated or damaged: Truncated File Read"),
    (b"GIF89a\x01", "GIF file, which is truncated or damaged"),
    (b"RIFF\x04\x00\x00\x00WEBP", "WebP file, which is truncated or damaged"),
])
def test_a_truncated_file_of_a_known_format_is_named_so(data, detail):
    """A PNG cut after its header (valid signature) was refused as "not a PNG": bytes that
    begin with a format's signature are that format's file, truncated or damaged."""
    with pytest.raises(MediaError) as refused:
        decode_image_bytes(data, MultiModalConfig())
    assert str(refused.value) == f"cannot decode the image: its {len(data)} bytes begin as a " \
        f"{detail}"


def test_url_without_scheme_is_named_as_such():
    """A bare base64 payload (the data: prefix forgotten) was refused as "got scheme
    'iVBORw0KGgoAAAA'": it has no scheme, and the refusal now says so and what to add."""
    from kvflow.multimodal.video import VideoError, load_video_url

    payload = base64.b64encode(PNG).decode()
    with pytest.raises(MediaError) as refused:
        load_image_url(payload, MultiModalConfig())
    assert str(refused.value).endswith(
        f"got {payload[:16]!r}... (no scheme: inline data needs the data:<type>;base64, prefix)")
    with pytest.raises(MediaError, match=r"got scheme 'ftp'$"):
        load_image_url("ftp://host/cat.png", MultiModalConfig())
    with pytest.raises(VideoError, match=r"\(no scheme: inline data needs"):
        load_video_url(payload, MultiModalConfig())


@pytest.mark.parametrize("url", ["http://[::1/cat.png", "https://[bad]/cat.png"])
def test_an_unparsable_url_names_its_part(url):
    """A URL urllib cannot split (an unclosed or invalid IPv6 host) was a bare ValueError
    ("Invalid IPv6 URL"), which the server answered naming only ``messages``: it is a
    MediaError (VideoError) naming its image_url (video_url) part."""
    from kvflow.multimodal import load_chat_media

    for kind, code in (("image", "invalid_image"), ("video", "invalid_video")):
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": f"{kind}_url", f"{kind}_url": {"url": url}}]}]
        with pytest.raises(MediaError, match="malformed URL") as refused:
            load_chat_media(messages, MultiModalConfig(allowed_media_domains="example.com"))
        assert (refused.value.param, refused.value.code) == \
            (f"messages.0.content.1.{kind}_url", code)
