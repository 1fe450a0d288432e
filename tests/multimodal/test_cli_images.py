"""``kvflow generate --image FILE`` / ``--video FILE`` on the tiny Qwen2-VL: the printed
completion is the text of transformers' greedy tokens for the same prompt and image or video
(plain prompt with a placeholder, and --chat, rendered by the HF processor's chat template); a
missing file, or a video without PyAV, is one error line."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.cli import main
from kvflow.entrypoints.cli_generate import _read_videos
from kvflow.multimodal import video
from tests.multimodal.conftest import (
    PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    expand,
    hf_generate,
    hf_video_pixels,
    hf_video_reference,
    png_bytes,
    random_image,
    random_video,
)

ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--temperature", "0", "--max-tokens",
        "6", "--ignore-eos"]


def test_generate_with_image_files(tiny_qwen2_vl, tmp_path, capsys):
    image = random_image(98, 70, 41)
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(image))
    tok = tiny_qwen2_vl.tokenizer
    prompt = f"a {PLACEHOLDER} is"
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", prompt, "--image",
                 str(path), *ARGS]) == 0
    want = tok.decode(hf_generate(tiny_qwen2_vl, prompt, [image], 6))
    assert capsys.readouterr().out.rstrip("\n") == prompt + want
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
        add_generation_prompt=True, tokenize=False)
    misnamed = tmp_path / "cat.tif"  # a PNG under a name that says TIFF: the bytes decide
    misnamed.write_bytes(png_bytes(image))
    for file in (path, misnamed):
        assert main(["generate", "--model", tiny_qwen2_vl.path, "--chat", "--prompt", "what?",
                     "--image", str(file), *ARGS]) == 0
        assert capsys.readouterr().out.rstrip("\n") == \
            tok.decode(hf_generate(tiny_qwen2_vl, text, [image], 6))


def test_missing_or_bad_image_file_is_one_error_line(tiny_qwen2_vl, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    for path, words in ((tmp_path / "nope.png", "cannot read it"), (bad, "cannot decode")):
        assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", PLACEHOLDER,
                     "--image", str(path), *ARGS]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvflow: error: --image {path}") and words in err


def test_an_image_the_model_cannot_take_names_its_file(tiny_qwen2_vl, tmp_path, capsys):
    """A 1 x 300 image passes the file checks and is refused by the model's processor
    (transformers' aspect-ratio limit, 200): its error lacked the ``--image FILE:`` prefix
    the other --image errors have."""
    good, thin = tmp_path / "good.png", tmp_path / "thin.png"
    random_image(28, 28, 0).save(good)
    random_image(1, 300, 0).save(thin)
    for prompt in (["--prompt", f"{PLACEHOLDER} {PLACEHOLDER}"], ["--chat", "--prompt", "?"]):
        assert main(["generate", "--model", tiny_qwen2_vl.path, *prompt, "--image", str(good),
                     "--image", str(thin), *ARGS]) == 2
        assert capsys.readouterr().err == (f"kvflow: error: --image {thin}: the image cannot "
                                           "be preprocessed: absolute aspect ratio must be "
                                           "smaller than 200, got 300.0\n")


def test_video_file_without_pyav_is_one_error_line(tiny_qwen2_vl, tmp_path, capsys,
                                                   monkeypatch):
    """PyAV is an optional extra: without it (hidden here) ``--video`` stops before the model
    loads with one line naming PyAV and the extra, worded for the command line (the server's
    hint speaks of video_url data URLs)."""
    monkeypatch.setitem(sys.modules, "av", None)  # ``import av`` raises ImportError
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00\x00\x00\x18ftypmp42")
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", VIDEO_PLACEHOLDER,
                 "--video", str(clip), *ARGS]) == 2
    assert capsys.readouterr().err == (
        f"kvflow: error: --video {clip}: decoding video files needs PyAV, which is not "
        "installed: pip install 'kvflow[video]' (or extract the frames and pass them as "
        "--image files, which the model then reads as separate images, not as one video)\n")
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", VIDEO_PLACEHOLDER,
                 "--video", str(tmp_path / "nope.mp4"), *ARGS]) == 2
    assert "--video" in capsys.readouterr().err


def test_video_file_data_urls(tmp_path, monkeypatch):
    """The --video data URL (decoder stubbed: PyAV is optional): the file name's video/* type,
    video/mp4 for another or for video/jpeg (the server's base64-frames form), the bytes in
    base64; a decoder's ValueError names the flag and file."""
    frames = [object()]
    monkeypatch.setattr(video, "decode_video_bytes", lambda data, config: frames)
    config = EngineConfig.from_kwargs(model="m")
    paths = []
    for name in ("a.webm", "b.jpg", "c.bin"):
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_bytes(b"abc")  # base64 "YWJj"
    assert _read_videos(paths, config) == [("data:video/webm;base64,YWJj", frames),
                                           ("data:video/mp4;base64,YWJj", frames),
                                           ("data:video/mp4;base64,YWJj", frames)]

    def refuse(data, config):
        raise video.VideoError("the video has no frames")

    monkeypatch.setattr(video, "decode_video_bytes", refuse)
    with pytest.raises(ValueError, match=f"^--video {paths[0]}: the video has no frames$"):
        _read_videos(paths, config)


def test_generate_with_a_video_file(tiny_qwen2_vl, tmp_path, capsys):
    """A 4-frame 56 x 56 H.264 file (PyAV; skipped without it): the completion is the text
    of transformers' greedy tokens given the frames PyAV decodes from the same file (in
    transformers' ``pixel_values_videos`` layout), as a plain prompt and with --chat. (2 x 2
    merged tokens a frame pair: with more temporal patches than that, transformers 5's text
    positions after a video leave vLLM's rule, which kvflow keeps; see
    ``mrope_input_positions``.)"""
    av = pytest.importorskip("av")
    clip = tmp_path / "clip.mp4"
    with av.open(str(clip), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for frame in random_video(4, 56, 9):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(clip)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert frames.shape == (4, 56, 56, 3)
    grid = hf_video_pixels(frames)[1]
    tok = tiny_qwen2_vl.tokenizer
    prompt = f"a {VIDEO_PLACEHOLDER} is"
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", prompt, "--video",
                 str(clip), *ARGS]) == 0
    ids = expand(tiny_qwen2_vl, prompt, [("video", grid)])
    want = hf_video_reference(tiny_qwen2_vl, ids, 6, video=frames)[1]
    assert capsys.readouterr().out.rstrip("\n") == prompt + tok.decode(want)
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--chat", "--prompt", "what?",
                 "--video", str(clip), *ARGS]) == 0
    ids = expand(tiny_qwen2_vl, text, [("video", grid)], special=False)
    want = hf_video_reference(tiny_qwen2_vl, ids, 6, video=frames)[1]
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(want)
