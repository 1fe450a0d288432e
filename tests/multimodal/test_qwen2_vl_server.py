"""Qwen2-VL through ``kvflow serve``: /v1/chat/completions with ``image_url`` and
``video_url`` data URLs.

Oracle: transformers' ``Qwen2VLProcessor`` (chat template + placeholder expansion) and
``Qwen2VLForConditionalGeneration.generate`` on the same tiny random weights: the server's
greedy tokens must equal them for 0, 1 and 2 images of different sizes. Bad images get a 400
naming the ``image_url`` part and the limit or defect, the server keeps serving and leaks no
KV block; the encoder cache's counters in /metrics move as hand-counted.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import zlib

import httpx
import pytest
import torch

from tests.e2e.conftest import ServerProcess
from tests.multimodal.conftest import (
    data_url,
    decoded_jpeg_frames,
    expand,
    hf_generate,
    hf_prompt_ids,
    hf_video_reference,
    jpeg_frames_url,
    png_bytes,
    random_image,
    random_video,
)

MAX_TOKENS = 6
MAX_IMAGE_BYTES = 300_000  # QWEN2_VL_SERVER_ARGS' --max-image-bytes


@pytest.fixture(scope="module")
def server(qwen2_vl_server):
    """The session's shared Qwen2-VL server (tests/multimodal/conftest.py; its
    ``--allowed-local-media-path`` is test_local_media.py's)."""
    return qwen2_vl_server


def chat(server: ServerProcess, content: list[dict], max_tokens: int = MAX_TOKENS
         ) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def hf_chat_tokens(tiny, texts_and_images: list) -> list[int]:
    """transformers' greedy tokens for one user turn of text and image parts, rendered by the
    HF processor's own chat template."""
    parts = [{"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p}
             for p in texts_and_images]
    text = tiny.processor.apply_chat_template([{"role": "user", "content": parts}],
                                              add_generation_prompt=True, tokenize=False)
    images = [p for p in texts_and_images if not isinstance(p, str)]
    return hf_generate(tiny, text, images, MAX_TOKENS)


def cases():
    a, b, c = random_image(84, 56, 1), random_image(120, 200, 2), random_image(300, 90, 3)
    return [["describe nothing at all"], [a, "what is this?"], ["compare", b, c, "now"]]


def to_content(parts: list) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else image_part(data_url(p))
            for p in parts]


@pytest.mark.parametrize("case", range(3), ids=["0_images", "1_image", "2_images"])
def test_chat_greedy_tokens_equal_transformers(server, tiny_qwen2_vl, case):
    parts = cases()[case]
    resp = chat(server, to_content(parts))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == hf_chat_tokens(tiny_qwen2_vl, parts)


def test_encoder_cache_counters_and_no_prefix_sharing_across_images(server, tiny_qwen2_vl):
    """Same image after different text: encoded once, found cached the second time. Same text
    with another image: encoded, no prefix-cache hit, and transformers' tokens."""
    image, other = random_image(112, 84, 11), random_image(112, 84, 12)
    before = server.metrics()
    first = chat(server, [{"type": "text", "text": "one"}, image_part(data_url(image))])
    second = chat(server, [{"type": "text", "text": "two"}, image_part(data_url(image))])
    assert first.status_code == second.status_code == 200
    mid = server.metrics()
    delta = {name: server.value(mid, name) - server.value(before, name) for name in (
        "kvflow:encoder_inputs_total", "kvflow:encoder_cache_hits_total",
        "kvflow:encoder_cache_queries_total")}
    assert delta == {"kvflow:encoder_inputs_total": 1, "kvflow:encoder_cache_hits_total": 1,
                     "kvflow:encoder_cache_queries_total": 2}
    third = chat(server, [{"type": "text", "text": "two"}, image_part(data_url(other))])
    after = server.metrics()
    assert third.json()["choices"][0]["token_ids"] == \
        hf_chat_tokens(tiny_qwen2_vl, ["two", other])
    assert third.json()["choices"][0]["token_ids"] != \
        second.json()["choices"][0]["token_ids"]
    assert server.value(after, "kvflow:encoder_inputs_total") - \
        server.value(mid, "kvflow:encoder_inputs_total") == 1
    assert server.value(after, "kvflow:prefix_cache_hits_total") == \
        server.value(mid, "kvflow:prefix_cache_hits_total")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels, with one tiny IDAT (never
    decoded: the size check comes first)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def bmp_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    random_image(32, 32, 5).save(buf, format="TIFF")
    return buf.getvalue()


PNG = png_bytes(random_image(64, 64, 4))
BAD_IMAGES = [  # (id, url, words the message must hold)
    ("truncated_png", data_url(PNG[:len(PNG) // 2]), ["truncated"]),
    # a 1 x 1 image is resized up as transformers does; one 300 times taller than wide is not
    ("aspect_ratio_300", data_url(random_image(1, 300, 6)), ["aspect ratio", "200"]),
    ("20000x20000", data_url(png_header_only(20000, 20000)), ["pixels"]),
    ("bad_base64", "data:image/png;base64,iVBORw0KGgo***notbase64***", ["base64"]),
    ("unsupported_media_type", data_url(PNG, "image/tiff"), ["image/tiff", "not supported"]),
    ("tiff_sent_as_png", data_url(bmp_bytes()), ["TIFF", "not supported"]),
    ("text_data_url", "data:text/plain;base64,aGVsbG8=", ["text/plain", "not supported"]),
    ("over_byte_cap", data_url(random_image(448, 448, 7)), ["--max-image-bytes"]),
    ("remote_url_off_by_default", "http://127.0.0.1:9/cat.png", ["--allowed-media-domains"]),
    # the shared server has --allowed-local-media-path (test_local_media.py's folder); a
    # file:// URL without the flag is refused by the same load_chat_media, checked there
    ("file_url_outside_the_allowed_path", "file:///etc/passwd",
     ["not under --allowed-local-media-path"]),
]


@pytest.mark.parametrize("url,words", [b[1:] for b in BAD_IMAGES], ids=[b[0] for b in BAD_IMAGES])
def test_bad_image_is_a_400_naming_the_part(server, url, words):
    resp = chat(server, [{"type": "text", "text": "look"}, image_part(url)])
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages.0.content.1.image_url", error
    assert error["code"] == "invalid_image"
    for word in words:
        assert word in error["message"], error["message"]


def test_other_refusals_name_their_field(server):
    detail = chat(server, [{"type": "image_url",
                            "image_url": {"url": data_url(PNG), "detail": "low"}}])
    assert detail.status_code == 400
    assert detail.json()["error"]["param"] == "messages.0.content.0.image_url.detail"
    stray = chat(server, [{"type": "text", "text": "<|image_pad|> without an image"}])
    assert stray.status_code == 400
    assert "placeholder" in stray.json()["error"]["message"]


def test_server_keeps_serving_without_leaks_after_bad_images(server, tiny_qwen2_vl):
    for _, url, _ in BAD_IMAGES:
        assert chat(server, [image_part(url)]).status_code == 400
    parts = cases()[1]
    resp = chat(server, to_content(parts))
    assert resp.json()["choices"][0]["token_ids"] == hf_chat_tokens(tiny_qwen2_vl, parts)
    metrics = server.metrics()
    assert server.value(metrics, "kvflow:kv_cache_free_blocks") == \
        server.value(metrics, "kvflow:kv_cache_usable_blocks")
    assert server.value(metrics, "kvflow:num_requests_running") == 0


def test_tokenize_counts_expanded_images_and_completions_refuse_placeholders(
        server, tiny_qwen2_vl):
    """/tokenize of a conversation with an image gives the expanded prompt that chat
    generation uses (transformers' processor's ids); a completion prompt holding an image
    placeholder (no way to attach the image) is a 400."""
    image = random_image(84, 56, 21)
    content = [{"type": "text", "text": "look"}, image_part(data_url(image))]
    resp = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": content}]}, timeout=60)
    assert resp.status_code == 200, resp.text
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    want = hf_prompt_ids(tiny_qwen2_vl, text, [image])
    assert resp.json()["tokens"] == want and resp.json()["count"] == len(want)
    usage = chat(server, content).json()["usage"]
    assert usage["prompt_tokens"] == len(want)
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "a <|image_pad|> b", "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt"
    assert "image_url" in resp.json()["error"]["message"]
    # a video placeholder: videos go in chat video_url parts
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "a <|video_pad|> b", "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert resp.json()["error"]["message"] == (
        "the prompt has 1 video placeholder(s) ('<|vision_start|><|video_pad|><|vision_end|>') "
        "but 0 video(s) were given: put exactly one placeholder where each video goes (images "
        "and videos go in /v1/chat/completions image_url and video_url parts)")
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"prompt": "a plain prompt", "max_tokens": 2})
    assert ok.status_code == 200


def test_streamed_chat_with_images_equals_transformers(server, tiny_qwen2_vl):
    """The SSE path: the chunks' token ids join to transformers' greedy tokens, and the usage
    chunk counts the expanded image tokens."""
    parts = cases()[2]
    body = {"messages": [{"role": "user", "content": to_content(parts)}], "stream": True,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    tokens, usage = [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    assert tokens == hf_chat_tokens(tiny_qwen2_vl, parts)
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"} if not isinstance(p, str) else
                                      {"type": "text", "text": p} for p in parts]}],
        add_generation_prompt=True, tokenize=False)
    images = [p for p in parts if not isinstance(p, str)]
    assert usage["prompt_tokens"] == len(hf_prompt_ids(tiny_qwen2_vl, text, images))


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_chat_video_url_equals_transformers(server, tiny_qwen2_vl):
    """A ``data:video/jpeg;base64,<frame>,...`` video_url part (4 JPEG frames of 56 x 56):
    the greedy tokens equal transformers' on the decoded frames."""
    video = random_video(4, 56, 40)
    url = jpeg_frames_url(video)
    resp = chat(server, [{"type": "text", "text": "watch"}, video_part(url)])
    assert resp.status_code == 200, resp.text
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "watch"}, {"type": "video"}]}],
        add_generation_prompt=True, tokenize=False)
    ids = expand(tiny_qwen2_vl, text, [("video", [2, 4, 4])], special=False)
    _, want = hf_video_reference(tiny_qwen2_vl, ids, MAX_TOKENS,
                                 video=decoded_jpeg_frames(url))
    assert resp.json()["choices"][0]["token_ids"] == want
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)


def test_bad_videos_are_a_400_naming_the_part(server):
    """Two videos over the default limit of one (before decoding), a video file without
    PyAV (or, with it, bytes that are no video), a frame that is no JPEG, an image media
    type, more JPEG frames than media_io_kwargs video.num_frames (32): 400s naming the part
    (the count: ``messages``) with code ``invalid_video``."""
    frames = jpeg_frames_url(random_video(2, 56, 41))
    over = chat(server, [video_part(frames), video_part(frames)])
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "messages"
    assert "2 videos in one conversation; the limit is 1" in over.json()["error"]["message"]
    mp4 = "data:video/mp4;base64,AAAAIGZ0eXBpc29t"
    no_file = "PyAV" if importlib.util.find_spec("av") is None else "cannot decode the video"
    many = jpeg_frames_url(random_video(33, 28, 42))
    for url, words in ((mp4, no_file), ("data:video/jpeg;base64,AAAA", "cannot decode"),
                       (data_url(PNG), "video/ media type"),
                       (many, "33 JPEG frames; the limit is 32 frames per video")):
        resp = chat(server, [{"type": "text", "text": "x"}, video_part(url)])
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "messages.0.content.1.video_url", error
        assert error["code"] == "invalid_video" and words in error["message"], error


def test_mm_processor_kwargs_resize_the_images_as_transformers_does(server, tiny_qwen2_vl):
    """/v1/chat/completions' mm_processor_kwargs (a 400 unsupported_parameter before) reach
    the image processor: the prompt's ids are transformers' processor's with the same
    kwargs (fewer image tokens than without), and so are the greedy tokens; a key the
    processor does not take is a 400 naming mm_processor_kwargs."""
    image = random_image(140, 112, 44)
    small = {"max_pixels": 56 * 56 * 2}
    body = {"messages": [{"role": "user", "content": [image_part(data_url(image)),
                                                      {"type": "text", "text": "what?"}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions",
                      json={**body, "mm_processor_kwargs": small}, timeout=120)
    assert resp.status_code == 200, resp.text
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = tiny_qwen2_vl.processor(text=[text], images=[image], return_tensors="pt",
                                     **small)
    assert resp.json()["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert resp.json()["prompt_token_ids"] != hf_prompt_ids(tiny_qwen2_vl, text, [image])
    with torch.no_grad():
        want = tiny_qwen2_vl.hf_model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert resp.json()["choices"][0]["token_ids"] == want
    bad = httpx.post(f"{server.url}/v1/chat/completions",
                     json={**body, "mm_processor_kwargs": {"max_pixel": 1}}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mm_processor_kwargs"
