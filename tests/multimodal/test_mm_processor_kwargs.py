"""``mm_processor_kwargs`` (vLLM's per-request overrides for the processor's call), offline
(``LLM.generate`` / ``LLM.chat`` and a dict prompt's own key) and on /v1/chat/completions.

Oracle: transformers' ``Qwen2VLProcessor`` called with the same kwargs: the same expanded
prompt ids (so token count), the same ``pixel_values`` and ``image_grid_thw``, and
``generate``'s greedy tokens from its inputs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.openai_errors import OpenAIError
from tests.multimodal.conftest import PLACEHOLDER, data_url, random_image

MAX_TOKENS = 4
TEXT = f"a {PLACEHOLDER} what is this?"
SMALL = {"max_pixels": 56 * 56 * 2}  # fewer pixels than the processor's default allows
LARGE = {"min_pixels": 280 * 280}  # more pixels than the image has


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=16)


def hf_inputs(tiny, images, **kwargs):
    return tiny.processor(text=[TEXT], images=images, return_tensors="pt", **kwargs)


def hf_greedy(tiny, inputs) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     min_new_tokens=MAX_TOKENS, eos_token_id=None,
                                     pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("kwargs", [SMALL, LARGE,
                                    {"size": {"shortest_edge": 28 * 28,
                                              "longest_edge": 56 * 84}}])
def test_the_processor_is_called_with_them_as_transformers_calls_it(llm, tiny_qwen2_vl,
                                                                    kwargs):
    """They were refused; now the image is resized as the HF processor resizes it with the
    same kwargs: same prompt ids (placeholder count), pixels, grid and greedy tokens."""
    image = random_image(140, 112, 5)
    want = hf_inputs(tiny_qwen2_vl, [image], **kwargs)
    default = hf_inputs(tiny_qwen2_vl, [image])
    assert want["input_ids"].shape != default["input_ids"].shape
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        processed = llm.engine.processor.process(
            {"prompt": TEXT, "multi_modal_data": {"image": [image]}}, mm_kwargs=kwargs)
    # min_pixels / max_pixels reach transformers as the size it wants, not through its
    # deprecated call arguments (a FutureWarning per image; removed in a later transformers)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert processed.token_ids == want["input_ids"][0].tolist()
    (feature,) = processed.mm_features
    pixels = np.frombuffer(feature.data, np.float32).reshape(feature.shape)
    np.testing.assert_allclose(pixels, want["pixel_values"].numpy(), rtol=0, atol=1e-6)
    assert list(feature.grid_thw) == want["image_grid_thw"][0].tolist()
    # through generate: the call's kwargs, or the dict prompt's own
    plain = {"prompt": TEXT, "multi_modal_data": {"image": [image]}}
    (by_call,) = llm.generate(plain, greedy(), use_tqdm=False, mm_processor_kwargs=kwargs)
    (by_prompt,) = llm.generate({**plain, "mm_processor_kwargs": kwargs}, greedy(),
                                use_tqdm=False)
    expected = hf_greedy(tiny_qwen2_vl, want)
    assert by_call.prompt_token_ids == by_prompt.prompt_token_ids == \
        want["input_ids"][0].tolist()
    assert by_call.outputs[0].token_ids == by_prompt.outputs[0].token_ids == expected


def test_a_dict_prompts_own_kwargs_win_over_the_calls(llm, tiny_qwen2_vl):
    image = random_image(140, 112, 5)
    own = {"max_pixels": 56 * 56 * 4}
    processed = llm.engine.processor.process(
        {"prompt": TEXT, "multi_modal_data": {"image": [image]}, "mm_processor_kwargs": own},
        mm_kwargs=SMALL)
    assert processed.token_ids == hf_inputs(tiny_qwen2_vl, [image], **own)["input_ids"][0] \
        .tolist() != hf_inputs(tiny_qwen2_vl, [image], **SMALL)["input_ids"][0].tolist()


@pytest.mark.parametrize("kwargs,match", [
    ({"max_pixel": 1000}, (r"mm_processor_kwargs \['max_pixel'\] are not taken by this "
                           r"model's image processor \(Qwen2VLImageProcessorPil\), which "
                           r"takes \[.*'max_pixels'")),
    ({"patch_size": 7}, (r"mm_processor_kwargs \['patch_size'\] cannot be changed per "
                         r"request: the vision encoder's geometry")),
    ({"return_tensors": "pt"}, r"mm_processor_kwargs \['return_tensors'\] cannot be changed"),
    ("max_pixels=1", r"mm_processor_kwargs must be a dict"),
    # an upscale beyond --max-image-pixels (default 4096 x 4096), refused before any resize
    ({"min_pixels": 4096 * 4096 + 1},
     r"mm_processor_kwargs min_pixels=16777217 would resize images to more than 16777216"),
    ({"size": {"shortest_edge": 10**9, "longest_edge": 10**9}},
     r"size.shortest_edge=1000000000 would resize"),
    ({"min_pixels": "many"}, r"min_pixels='many' must be an integer"),
])
def test_keys_the_processor_does_not_take_are_refused_naming_them(llm, kwargs, match):
    image = random_image(84, 56, 1)
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": [image]}}, greedy(),
                     use_tqdm=False, mm_processor_kwargs=kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_a_text_model_refuses_them(tiny_llama):
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="mm_processor_kwargs is for a vision-language "
                                         "model's image processor"):
        llm.generate("hi", greedy(), use_tqdm=False, mm_processor_kwargs=SMALL)
    with pytest.raises(ValueError, match="mm_processor_kwargs is for"):
        llm.generate({"prompt": "hi", "mm_processor_kwargs": SMALL}, greedy(),
                     use_tqdm=False)


def test_chat_takes_them_offline_and_over_http(llm, tiny_qwen2_vl):
    """LLM.chat(mm_processor_kwargs=...) and the /v1/chat/completions body field reach the
    processor (prompt token count as transformers' with the kwargs); a key it does not take
    is a 400 naming mm_processor_kwargs."""
    import asyncio
    from types import SimpleNamespace

    from kvflow.entrypoints.chat_render import ChatRendering

    image = random_image(140, 112, 6)
    message = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is this?"}]}]
    (out,) = llm.chat(message, greedy(), use_tqdm=False, mm_processor_kwargs=SMALL)
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "what is this?"}]}],
        add_generation_prompt=True)
    want = tiny_qwen2_vl.processor(text=[text], images=[image], return_tensors="pt", **SMALL)
    assert out.prompt_token_ids == want["input_ids"][0].tolist()

    renderer = SimpleNamespace(engine=SimpleNamespace(processor=llm.engine.processor))
    with pytest.raises(OpenAIError) as e:
        asyncio.run(ChatRendering.attach_images(renderer, [], "x", [1], {"max_pixel": 1}))
    assert (e.value.status, e.value.param) == (400, "mm_processor_kwargs")
    assert "['max_pixel'] are not taken" in str(e.value)


def test_video_frames_take_them_too(llm, tiny_qwen2_vl):
    """Each frame is resized as the image processor resizes it with the same kwargs (its
    resize keys replace the video's own bounds): the video's grid is the frame's, over
    ceil(frames / 2) temporal patches."""
    from tests.multimodal.conftest import random_video

    video = random_video(3, 140, 9)
    frame = tiny_qwen2_vl.processor.image_processor(images=[video[0]], return_tensors="np",
                                                    **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # max_pixels goes as the size
        _, grid = llm.engine.processor.mm_processor.preprocess_video(video, SMALL)
    assert grid == (2, *frame["image_grid_thw"][0][1:].tolist())
    _, default = llm.engine.processor.mm_processor.preprocess_video(video)
    assert default != grid


def test_side_length_sizes_are_refused_where_they_could_make_any_area(tiny_llava):
    """CLIP's processor (LLaVA) takes ``size`` as a side length: a large one on an elongated
    image could make an image of any area, so it is refused (the image limits bound
    images); keys that change no size pass."""
    from kvflow.multimodal.processor import load_image_processor
    from kvflow.multimodal.processor_kwargs import check_mm_processor_kwargs

    clip = load_image_processor(tiny_llava.path)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs \['size'\] are refused"):
        check_mm_processor_kwargs(clip, {"size": {"shortest_edge": 100_000}}, 4096 * 4096)
    assert check_mm_processor_kwargs(clip, {"do_normalize": False}, 4096 * 4096) == \
        {"do_normalize": False}
