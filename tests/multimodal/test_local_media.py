"""``--allowed-local-media-path DIR`` (vLLM's ``allowed_local_media_path``): chat
``image_url`` / ``video_url`` parts may name files under DIR as ``file://`` URLs.

Oracles: the same image sent as a data URL and transformers' greedy tokens (the image tests'
``hf_generate``) must both equal the file:// URL's tokens, offline and over HTTP; paths
whose resolution (``..``, a symlink) leads out of DIR, hand-built here, are refused naming the
part; without the flag a file:// URL is refused naming the flag.
"""

from __future__ import annotations

import base64
import io
import os

import httpx
import numpy as np
import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import MultiModalConfig
from kvflow.multimodal import MediaError, load_chat_media, load_video_url
from tests.multimodal.conftest import (
    data_url,
    hf_generate,
    png_bytes,
    qwen2_vl_server_declaration,
    random_image,
)

MAX_TOKENS = 6


def prestart_servers(fixture):
    """The shared ``qwen2_vl_server``, started ahead (``_prestart_next_module``)."""
    return [qwen2_vl_server_declaration(fixture)]


@pytest.fixture(scope="module")
def media(local_media_dir):
    """(allowed DIR with cat.png and a symlink out, an outside folder with secret.png, the
    image); DIR is the shared ``qwen2_vl_server``'s ``--allowed-local-media-path``."""
    allowed = local_media_dir
    outside = allowed.parent / "outside"
    image = random_image(70, 98, 5)
    (allowed / "cat.png").write_bytes(png_bytes(image))
    (outside / "secret.png").write_bytes(png_bytes(image))
    os.symlink(outside / "secret.png", allowed / "link.png")
    (allowed / "sub").mkdir()
    return allowed, outside, image


def user_turn(kind: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": f"{kind}_url", f"{kind}_url": {"url": url}},
        {"type": "text", "text": "what is it?"}]}]


def hf_tokens(tiny, image) -> list[int]:
    text = tiny.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                      {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True, tokenize=False)
    return hf_generate(tiny, text, [image], MAX_TOKENS)


def escapes(allowed) -> list[tuple[str, str]]:
    """(file:// URL, words of the refusal) for paths leading out of ``allowed``."""
    return [(f"file://{allowed}/../outside/secret.png", "not under --allowed-local-media-path"),
            (f"file://{allowed}/sub/../../outside/secret.png", "not under"),
            (f"file://{allowed}/link.png", "symlinks and '..' resolved"),
            (f"file://{allowed.parent}/outside/secret.png", "not under"),
            ("file:///etc/passwd", "not under"),
            (f"file://{allowed}", "not under"),  # DIR itself is no file under it
            (f"file://{allowed}/sub", "Is a directory"),
            (f"file://{allowed}/missing.png", "cannot read the file"),
            (f"file://otherhost{allowed}/cat.png", "host 'otherhost'"),
            (f"file://{allowed}/cat.png%00.txt", "NUL byte")]  # was a bare ValueError


def test_offline_file_url_equals_data_url_and_transformers(media, tiny_qwen2_vl):
    allowed, _, image = media
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=64, block_size=16,
              allowed_local_media_path=str(allowed))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = hf_tokens(tiny_qwen2_vl, image)
    for url in (f"file://{allowed}/cat.png", f"file://localhost{allowed}/cat.png",
                f"file://{allowed}/sub/../cat.png", data_url(image)):
        assert llm.chat(user_turn("image", url), greedy)[0].outputs[0].token_ids == want, url
    for url, words in escapes(allowed):
        with pytest.raises(MediaError, match=words) as info:
            llm.chat(user_turn("image", url), greedy)
        assert info.value.param == "messages.0.content.1.image_url", url
    with pytest.raises(MediaError, match="not under") as info:
        llm.chat(user_turn("video", f"file://{allowed}/link.png"), greedy)
    assert info.value.param == "messages.0.content.1.video_url"
    assert info.value.code == "invalid_video"
    assert not llm.engine.has_unfinished_requests()


def test_without_the_flag_file_urls_are_refused_naming_it(media):
    allowed = media[0]
    for kind in ("image", "video"):
        with pytest.raises(MediaError, match="--allowed-local-media-path DIR") as info:
            load_chat_media(user_turn(kind, f"file://{allowed}/cat.png"), MultiModalConfig())
        assert info.value.param == f"messages.0.content.1.{kind}_url"


def test_the_directory_must_exist(tmp_path):
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "nope", tmp_path / "f"):
        with pytest.raises(ValueError, match="allowed_local_media_path=.*not an existing dir"):
            MultiModalConfig(allowed_local_media_path=str(path))


def test_a_text_model_refuses_the_flag(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        LLM(tiny_llama.path, allowed_local_media_path=str(tmp_path))


def test_a_video_file_url_reads_the_frames_its_data_url_holds(media):
    """A video file (PyAV; skipped without it): 6 uniformly gray frames, levels 40 i, in a
    lossless MP4 under DIR, as file:// and as data:video/mp4 give the same frames, those
    levels."""
    av = pytest.importorskip("av")
    allowed = media[0]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"qp": "0"}
        for i in range(6):
            gray = np.full((48, 64, 3), 40 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(gray, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    (allowed / "clip.mp4").write_bytes(buf.getvalue())
    config = MultiModalConfig(allowed_local_media_path=str(allowed))
    frames = [load_video_url(url, config) for url in (
        f"file://{allowed}/clip.mp4",
        "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode())]
    levels = [[int(np.asarray(f)[24, 32].mean()) for f in v] for v in frames]
    assert levels[0] == levels[1]
    np.testing.assert_allclose(levels[0], [40 * i for i in range(6)], atol=3)


def test_server_file_url_equals_transformers_and_escapes_are_400s(
        media, tiny_qwen2_vl, qwen2_vl_server):
    allowed, _, image = media
    server = qwen2_vl_server  # started with --allowed-local-media-path DIR

    def chat(url: str) -> httpx.Response:
        body = {"messages": user_turn("image", url), "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)

    resp = chat(f"file://{allowed}/cat.png")
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == hf_tokens(tiny_qwen2_vl, image)
    for url, words in escapes(allowed)[:3]:
        resp = chat(url)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "messages.0.content.1.image_url"
        assert words in error["message"], error["message"]
