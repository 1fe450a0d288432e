"""Video inputs of Qwen2-VL and Qwen2.5-VL against transformers (fp32, CPU).

Oracle: transformers' ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
on the same weights, given ``pixel_values_videos`` built here with numpy in transformers'
``Qwen2VLVideoProcessor`` layout (its torchvision backend does not install next to the CPU
torch here; frames sized so that nothing is resized: 56 x 56 and 112 x 112 are multiples of
28 within the pixel bounds), ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``
(2 frames per temporal patch at transformers' default 2 fps: 1 s). kvflow's expanded prompt,
every prompt token's logprob and the greedy tokens must equal transformers'.
"""

from __future__ import annotations

import base64
import io
import sys
import types

import numpy as np
import pytest
from PIL import Image

from kvflow import LLM, SamplingParams
from kvflow.config import MultiModalConfig
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.models.qwen2_vl import mrope_input_positions
from kvflow.multimodal.video import VideoError, load_video_url
from tests.multimodal.conftest import (
    PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    decoded_jpeg_frames,
    expand,
    hf_video_reference,
    jpeg_frames_url,
    random_image,
    random_video,
)

MAX_TOKENS = 6


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          prompt_logprobs=0)


def kvflow_prompt_logprobs(out) -> list[float]:
    ids = out.prompt_token_ids
    return [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i > 0]


@pytest.fixture(scope="module")
def llm2(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=128, block_size=16,
               limit_mm_per_prompt={"image": 2, "video": 2})


@pytest.fixture(scope="module")
def llm25(tiny_qwen2_5_vl):
    return LLM(tiny_qwen2_5_vl.path, dtype="float32", num_kv_blocks=128, block_size=16)


def check_against_hf(out, tiny, want_ids, **hf_inputs):
    assert out.prompt_token_ids == want_ids
    want_lp, want_tokens = hf_video_reference(tiny, want_ids, MAX_TOKENS, **hf_inputs)
    np.testing.assert_allclose(kvflow_prompt_logprobs(out), want_lp, atol=1e-4, rtol=1e-4)
    assert out.outputs[0].token_ids == want_tokens


def test_qwen2_vl_video_array_and_frame_list(llm2, tiny_qwen2_vl, assert_no_leaks):
    """4 frames of 56 x 56 (2 temporal patches of 2 x 2 merged tokens) as a numpy array, and
    3 frames as a list of PIL images (the last repeated to fill the second temporal
    patch): prompt ids, prompt logprobs and greedy tokens equal transformers'."""
    text = f"look {VIDEO_PLACEHOLDER} what happens next?"
    four, three = random_video(4, 56, 1), random_video(3, 56, 2)
    frames = [Image.fromarray(f) for f in three]
    outs = llm2.generate([{"prompt": text, "multi_modal_data": {"video": four}},
                          {"prompt": text, "multi_modal_data": {"video": frames}}], params())
    for out, video in zip(outs, (four, three)):
        check_against_hf(out, tiny_qwen2_vl, expand(tiny_qwen2_vl, text, [("video", [2, 4, 4])]),
                         video=video)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert_no_leaks(llm2)


def test_qwen2_vl_image_and_video_in_one_prompt(llm2, tiny_qwen2_vl, assert_no_leaks):
    image, video = random_image(84, 56, 3), random_video(4, 56, 4)
    text = f"{PLACEHOLDER} then {VIDEO_PLACEHOLDER} compare"
    out = llm2.generate({"prompt": text, "multi_modal_data": {"image": image, "video": video}},
                        params())[0]
    want = expand(tiny_qwen2_vl, text, [("image", [1, 4, 6]), ("video", [2, 4, 4])])
    check_against_hf(out, tiny_qwen2_vl, want, video=video, image=image)
    assert_no_leaks(llm2)


def test_qwen2_5_vl_video_time_ids(llm25, tiny_qwen2_5_vl, assert_no_leaks):
    """112 x 112 frames (2 x 2 windows per frame); time ids 0 and 2 (tokens_per_second 2 x
    1 s per temporal patch), passed to transformers as second_per_grid_ts."""
    text = f"a clip {VIDEO_PLACEHOLDER} now say"
    video = random_video(4, 112, 5)
    out = llm25.generate({"prompt": text, "multi_modal_data": {"video": video}}, params())[0]
    want = expand(tiny_qwen2_5_vl, text, [("video", [2, 8, 8])])
    check_against_hf(out, tiny_qwen2_5_vl, want, video=video, second_per_grid_t=1.0)
    # the time scaling is what makes it right: without it (1 per patch) transformers differs
    lp_unscaled, _ = hf_video_reference(tiny_qwen2_5_vl, want, 1, video=video,
                                        second_per_grid_t=0.5)
    assert not np.allclose(kvflow_prompt_logprobs(out), lp_unscaled, atol=1e-4)
    assert_no_leaks(llm25)


def test_chat_video_url(llm2, tiny_qwen2_vl):
    video = random_video(4, 56, 6)
    url = jpeg_frames_url(video)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "watch"}, {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "and tell"}]}]
    out = llm2.chat(messages, params())[0]
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "watch"}, {"type": "video"},
                                      {"type": "text", "text": "and tell"}]}],
        add_generation_prompt=True)
    assert out.prompt == text
    want = expand(tiny_qwen2_vl, text, [("video", [2, 4, 4])], special=False)
    check_against_hf(out, tiny_qwen2_vl, want, video=decoded_jpeg_frames(url))


def test_same_text_other_video_never_shares_kv(llm2):
    """The prefix cache keys a video's blocks by its content: another video with the same
    tokens hits nothing; the same video again hits (no prompt_logprobs: those recompute the
    prompt)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    text = f"{VIDEO_PLACEHOLDER} describe the clip in detail please now"
    one, two = random_video(4, 56, 7), random_video(4, 56, 8)
    kv = llm2.engine.core.kv_cache_manager
    first = llm2.generate({"prompt": text, "multi_modal_data": {"video": one}}, greedy)[0]
    hits = kv.num_hits
    second = llm2.generate({"prompt": text, "multi_modal_data": {"video": two}}, greedy)[0]
    assert second.prompt_token_ids == first.prompt_token_ids
    assert kv.num_hits == hits
    llm2.generate({"prompt": text, "multi_modal_data": {"video": one}}, greedy)
    assert kv.num_hits > hits


def test_video_limits(tiny_qwen2_vl):
    """--limit-mm-per-prompt '{"video": 1}': two videos refused (offline prompt and chat,
    before any video is decoded); video 0 refuses every video."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=32,
              limit_mm_per_prompt='{"video": 1}')
    video = random_video(2, 56, 9)
    with pytest.raises(ValueError, match="2 videos in one prompt; the limit is 1"):
        llm.generate({"prompt": VIDEO_PLACEHOLDER * 2,
                      "multi_modal_data": {"video": [video, video]}}, params())
    parts = [{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA"}}] * 2
    with pytest.raises(ValueError, match="2 videos in one conversation; the limit is 1"):
        llm.chat([{"role": "user", "content": parts}], params())
    assert not llm.engine.has_unfinished_requests()
    none = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=32,
               limit_mm_per_prompt={"video": 0})
    with pytest.raises(ValueError, match="1 videos in one prompt; the limit is 0"):
        none.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": video}},
                      params())


@pytest.mark.parametrize("video,match", [
    (np.zeros((4, 56, 56, 3), np.float32), "uint8"),
    (np.zeros((56, 56, 3), np.uint8), "uint8"),
    ([Image.new("RGB", (56, 56)), Image.new("RGB", (28, 28))], "one size"),
    ([Image.new("RGB", (1, 300))], "frame of the video: .*aspect ratio"),
    ("clip.mp4", "numpy array"),
    ((np.zeros((2, 56, 56, 3), np.uint8), {"fps": 4.0}), "metadata"),
])
def test_bad_videos(llm2, video, match):
    with pytest.raises(ValueError, match=match):
        llm2.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": video}},
                      params())
    with pytest.raises(ValueError, match="1 video placeholder"):
        llm2.generate({"prompt": f"{VIDEO_PLACEHOLDER} x", "multi_modal_data": {}}, params())
    assert not llm2.engine.has_unfinished_requests()


def test_mrope_positions_hand_computed():
    """A video whose time ids pass its height and width ids: text after it starts one past
    the largest id (the original Qwen code's and vLLM's rule). Qwen2.5-VL, tokens_per_second
    4, 0.5 s per temporal patch: time step 2; 3 temporal patches of 1 x 2 merged tokens."""
    video = MultiModalFeature("video", "v", 2, 6, b"", (0, 0), (3, 2, 4), 0.5)
    positions, delta = mrope_input_positions([0] * 10, [video], 2, tokens_per_second=4)
    t = [0, 1, 2, 2, 4, 4, 6, 6, 7, 8]  # text 0 1 | video t = 2 + (0, 2, 4) | text 7 8
    h = [0, 1, 2, 2, 2, 2, 2, 2, 7, 8]
    w = [0, 1, 2, 3, 2, 3, 2, 3, 7, 8]
    assert positions.tolist() == [t, h, w]
    assert delta == 9 - 10
    plain, _ = mrope_input_positions([0] * 10, [video], 2)  # Qwen2-VL: step 1
    assert plain[0].tolist() == [0, 1, 2, 2, 3, 3, 4, 4, 5, 6]


def test_video_file_frames_sampled_uniformly():
    """A 40-frame H.264 MP4 (frame i uniformly gray at 6 i) decoded with PyAV (skipped where
    it is not installed: an optional dependency), media_io_kwargs num_frames 8: frames
    round(linspace(0, 39, 8)) = 0, 6, 11, 17, 22, 28, 33, 39; a 5-frame file keeps all 5."""
    av = pytest.importorskip("av")

    def mp4(frames: int) -> str:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=10)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            stream.options = {"qp": "0"}  # lossless: the gray levels survive
            for i in range(frames):
                gray = np.full((48, 64, 3), 6 * i, np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(gray, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()

    config = MultiModalConfig(media_io_kwargs={"video": {"num_frames": 8}})
    frames = load_video_url(mp4(40), config)
    assert [f.size for f in frames] == [(64, 48)] * 8
    got = [int(np.asarray(f)[24, 32].mean()) for f in frames]
    np.testing.assert_allclose(got, [6 * i for i in (0, 6, 11, 17, 22, 28, 33, 39)], atol=3)
    assert len(load_video_url(mp4(5), config)) == 5


class _StubVideoFile:
    """A stand-in for ``av`` (PyAV, an optional dependency) opening a video of ``count``
    64 x 48 frames, frame i uniformly gray at i % 256; ``converted`` counts the frames made
    into PIL images (``VideoFrame.to_image``)."""

    def __init__(self, count: int) -> None:
        self.count, self.converted = count, 0
        codec = types.SimpleNamespace(width=64, height=48)
        self.streams = types.SimpleNamespace(video=[types.SimpleNamespace(codec_context=codec)])

    def open(self, file):  # av.open
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def decode(self, stream):
        for i in range(self.count):
            yield types.SimpleNamespace(to_image=lambda i=i: self._image(i))

    def _image(self, i: int) -> Image.Image:
        self.converted += 1
        return Image.new("RGB", (64, 48), (i % 256,) * 3)


def test_a_long_video_file_keeps_only_its_sampled_frames(monkeypatch):
    """A video file's decoded frames are not all held as images: of 1000 frames with
    num_frames 8, the frames kept are round(linspace(0, 999, 8)) = 0, 143, 285, 428, 571,
    714, 856, 999 (as the first 8 of a short video are all of it), and at most 2 x 8 frames
    become images (a file of many large frames would otherwise fill memory: 1000 frames
    were converted before)."""
    config = MultiModalConfig(media_io_kwargs={"video": {"num_frames": 8}})
    for count, want in ((1000, [0, 143, 285, 428, 571, 714, 856, 999]),
                        (5, [0, 1, 2, 3, 4]), (8, list(range(8)))):
        stub = _StubVideoFile(count)
        monkeypatch.setitem(sys.modules, "av", stub)
        frames = load_video_url("data:video/mp4;base64,AAAA", config)
        assert [int(np.asarray(f)[0, 0, 0]) for f in frames] == [i % 256 for i in want]
        assert all(f.mode == "RGB" and f.size == (64, 48) for f in frames)
        assert stub.converted <= 16, count
    with pytest.raises(VideoError, match="the video has no frames"):
        monkeypatch.setitem(sys.modules, "av", _StubVideoFile(0))
        load_video_url("data:video/mp4;base64,AAAA", config)


def test_a_refused_video_host_is_named_as_a_video():
    """An http(s) video URL from a host not allowed was refused in an image's words
    ("fetching images from ...; or send the image inline")."""
    with pytest.raises(ValueError, match=r"^fetching videos from '127.0.0.1' is not allowed "
                                         r"\(this server fetches no media URLs; start it with "
                                         r"--allowed-media-domains\); or send the video "
                                         r"inline as a data: URL$"):
        load_video_url("http://127.0.0.1:9/clip.mp4", MultiModalConfig())
    with pytest.raises(ValueError, match=r"^fetching videos from 'example.com' is not allowed "
                                         r"\(allowed hosts: 127.0.0.1\)"):
        load_video_url("https://example.com/clip.mp4",
                       MultiModalConfig(allowed_media_domains="127.0.0.1"))


def test_a_bad_jpeg_frame_is_named_by_its_index():
    """A data:video/jpeg URL whose second frame does not decode said only "cannot decode the
    image"; the refusal now names the frame (AAAA: 3 bytes, no image format)."""
    url = jpeg_frames_url(random_video(1, 56, 0)) + ",AAAA"
    with pytest.raises(ValueError, match=r"^frame 1 of 2: cannot decode the image: its 3 "
                                         r"bytes are not"):
        load_video_url(url, MultiModalConfig())
    assert len(load_video_url(url.removesuffix(",AAAA"), MultiModalConfig())) == 1


def test_jpeg_frames_beyond_num_frames_are_refused_before_decoding(monkeypatch):
    """A data:video/jpeg URL had no frame-count limit: many small JPEGs of large frames
    decoded to far more memory than --max-image-bytes suggests. Now at most media_io_kwargs
    video.num_frames frames (default 32) are taken, counted before any frame decodes."""
    import kvflow.multimodal.video as video_mod

    three = jpeg_frames_url(random_video(3, 56, 1))
    config = MultiModalConfig(media_io_kwargs={"video": {"num_frames": 2}})
    decoded = []
    real = video_mod.decode_image_bytes
    monkeypatch.setattr(video_mod, "decode_image_bytes",
                        lambda blob, cfg: decoded.append(1) or real(blob, cfg))
    with pytest.raises(VideoError, match=r"^the video has 3 JPEG frames; the limit is 2 "
                                         r"frames per video \(--media-io-kwargs"):
        load_video_url(three, config)
    assert decoded == []
    assert len(load_video_url(three, MultiModalConfig(
        media_io_kwargs={"video": {"num_frames": 3}}))) == 3
    default = jpeg_frames_url(random_video(33, 28, 2))
    with pytest.raises(VideoError, match="33 JPEG frames; the limit is 32 frames"):
        load_video_url(default, MultiModalConfig())
    assert len(load_video_url(default.rsplit(",", 1)[0], MultiModalConfig())) == 32


def _hf_second_per_grid_ts(tiny, video: np.ndarray, fps: float) -> list[float]:
    """transformers' ``Qwen2_5_VLProcessor._process_videos`` on one video whose frames run
    at ``fps`` per second (its video metadata's frame rate, as transformers 5 reads it), the
    video processor (it needs torchvision, which does not install here) stubbed to return
    the grid and transformers' own batched metadata."""
    import copy

    from transformers.video_utils import make_batched_metadata, make_batched_videos

    class StubVideoProcessor:
        temporal_patch_size, merge_size = 2, 2

        def __call__(self, videos, video_metadata=None, **kwargs):
            videos = make_batched_videos(videos)
            grid = [-(-len(videos[0]) // 2), video.shape[1] // 14, video.shape[2] // 14]
            return {"video_grid_thw": np.array([grid]),
                    "video_metadata": make_batched_metadata(videos, video_metadata)}

    processor = copy.copy(tiny.processor)
    processor.video_processor = StubVideoProcessor()
    out, _ = processor._process_videos([video], video_metadata=[{
        "total_num_frames": len(video), "fps": fps, "frames_indices": list(range(len(video)))}])
    return out["second_per_grid_ts"]


def test_qwen2_5_vl_fps_sets_the_seconds_per_temporal_patch(llm25, tiny_qwen2_5_vl,
                                                            assert_no_leaks):
    """mm_processor_kwargs ``fps`` (was refused: the image processor does not take it) is
    the frames' rate: Qwen2.5-VL's time ids step by tokens_per_second x temporal_patch_size
    / fps, transformers' second_per_grid_ts for a video at that rate (fps 1: 2 s per
    temporal patch, time ids 0 and 4; fps 4: 0.5 s, 0 and 1; the default 2: 0 and 2); the
    logprobs and greedy tokens equal transformers' given that second_per_grid_ts. 224 x 224
    frames (8 x 8 merged tokens): the time ids stay below 8, where transformers 5.25 and
    vLLM start the text after a video alike (transformers at the start plus 8, vLLM one past
    the largest id)."""
    text = f"a clip {VIDEO_PLACEHOLDER} now say"
    video = random_video(4, 224, 5)
    want = expand(tiny_qwen2_5_vl, text, [("video", [2, 16, 16])])
    for fps in (1, 4.0):
        (seconds,) = _hf_second_per_grid_ts(tiny_qwen2_5_vl, video, fps)
        assert seconds == 2 / fps
        out = llm25.generate({"prompt": text, "multi_modal_data": {"video": video}}, params(),
                             mm_processor_kwargs={"fps": fps})[0]
        check_against_hf(out, tiny_qwen2_5_vl, want, video=video, second_per_grid_t=seconds)
        # a dict prompt's own key too
        own = llm25.generate({"prompt": text, "multi_modal_data": {"video": video},
                              "mm_processor_kwargs": {"fps": fps}}, params())[0]
        assert own.outputs[0].token_ids == out.outputs[0].token_ids
    assert_no_leaks(llm25)


@pytest.mark.parametrize("fps", [0, -1.0, float("inf"), float("nan"), "2", True, [2.0]])
def test_a_bad_fps_is_refused_naming_it(llm2, fps):
    video = random_video(2, 56, 3)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs fps=.* must be a number > 0"):
        llm2.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": video}},
                      params(), mm_processor_kwargs={"fps": fps})
    assert not llm2.engine.has_unfinished_requests()


def test_fps_is_refused_for_a_model_without_videos(tiny_llava):
    from kvflow.multimodal.processor import load_image_processor
    from kvflow.multimodal.processor_kwargs import check_mm_processor_kwargs

    image_processor = load_image_processor(tiny_llava.path)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs \['fps'\] are for videos; "
                                         "this model takes images only"):
        check_mm_processor_kwargs(image_processor, {"fps": 2.0}, 4096 * 4096)
    assert check_mm_processor_kwargs(image_processor, {"fps": 2.0}, 4096 * 4096,
                                     takes_videos=True) == {"fps": 2.0}
