"""Qwen2-VL end to end through the offline API, against transformers (fp32, CPU).

Oracle: transformers' ``Qwen2VLProcessor`` (PIL image processor, placeholder expansion) and
``Qwen2VLForConditionalGeneration.generate`` on the same saved weights. kvflow must expand the
placeholders to the same prompt ids and produce the same greedy tokens for prompts with 0, 1
and 2 images of different sizes, in one batch, under chunked prefill that splits images, and
with preemption; the encoder runs once per distinct image, and equal text with another image
never hits the prefix cache.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import (
    PLACEHOLDER,
    data_url,
    hf_generate,
    hf_prompt_ids,
    png_bytes,
    random_image,
)

MAX_TOKENS = 8


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=16)


def cases():
    """(text, images): 0, 1 and 2 images of different sizes and aspect ratios."""
    a, b, c = random_image(84, 56, 1), random_image(120, 200, 2), random_image(300, 90, 3)
    return [
        ("the quick brown fox jumps over", []),
        (f"a {PLACEHOLDER} what is this?", [a]),
        (f"{PLACEHOLDER} and {PLACEHOLDER} compare them", [b, c]),
    ]


def test_prompt_ids_expand_like_transformers(llm, tiny_qwen2_vl):
    for text, images in cases():
        processed = llm.engine.processor.process(
            {"prompt": text, "multi_modal_data": {"image": images}})
        assert processed.token_ids == hf_prompt_ids(tiny_qwen2_vl, text, images)
        assert len(processed.mm_features or []) == len(images)


def test_greedy_tokens_equal_transformers(llm, tiny_qwen2_vl, assert_no_leaks):
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
    outs = llm.generate(prompts, greedy())  # one batch: text-only and image rows together
    for (text, images), out in zip(cases(), outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)
    assert_no_leaks(llm)


def test_chunked_prefill_splits_images(tiny_qwen2_vl, assert_no_leaks):
    """A 24-token budget cuts every image across steps: rows come from the encoder cache."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=8,
              max_num_batched_tokens=24, enable_prefix_caching=False)
    text, images = cases()[2]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy())[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)
    encoder = llm.engine.core.scheduler.encoder
    assert encoder.num_encoded == 2
    assert (encoder.budget_per_step, encoder.cache_size) == (24, 16384)  # the defaults
    assert_no_leaks(llm)


def test_small_encoder_budget_and_preemption(tiny_qwen2_vl, assert_no_leaks):
    """An encoder budget below one image (each image then runs alone in its step), a small
    encoder cache, and a KV pool so small that requests are preempted and recomputed: same
    tokens."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=14, block_size=8,
              max_num_batched_tokens=64, max_num_encoder_input_tokens=8,
              encoder_cache_size=100, allowed_media_domains="Images.Example.com")
    encoder = llm.engine.core.scheduler.encoder
    assert (encoder.budget_per_step, encoder.cache_size) == (8, 100)  # given: read
    mm_config = llm.engine.processor.mm_processor.config  # where image URLs are checked
    assert mm_config.media_domains() == {"images.example.com"}
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
    outs = llm.generate(prompts * 2, greedy(12))
    assert llm.engine.core.scheduler.num_preemptions > 0
    for (text, images), out in zip(cases() * 2, outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, 12)
    assert_no_leaks(llm)


def test_same_text_other_image_never_shares_kv(llm, tiny_qwen2_vl):
    text = f"{PLACEHOLDER} describe the picture in detail please"
    one, two = random_image(112, 112, 10), random_image(112, 112, 11)
    kv = llm.engine.core.kv_cache_manager
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": one}}, greedy())[0]
    hits_before = kv.num_hits
    second = llm.generate({"prompt": text, "multi_modal_data": {"image": two}}, greedy())[0]
    assert second.prompt_token_ids == first.prompt_token_ids  # same tokens...
    assert kv.num_hits == hits_before  # ...but no block of the first is reused
    assert first.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, [one], MAX_TOKENS)
    assert second.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, [two], MAX_TOKENS)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    third = llm.generate({"prompt": text, "multi_modal_data": {"image": one}}, greedy())[0]
    assert kv.num_hits > hits_before  # the same image again: its blocks are hit
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_same_image_twice_encodes_once(llm):
    encoder = llm.engine.core.scheduler.encoder
    image = random_image(140, 98, 20)
    before = (encoder.num_encoded, encoder.num_hits)
    for prefix in ("first", "second"):  # different text before it: no prefix-cache hit
        llm.generate({"prompt": f"{prefix} {PLACEHOLDER}", "multi_modal_data": {"image": image}},
                     greedy(2))
    assert encoder.num_encoded - before[0] == 1
    assert encoder.num_hits - before[1] == 1


def test_chat_with_image_url(llm, tiny_qwen2_vl):
    image = random_image(70, 140, 30)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look:"},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is it?"}]}]
    out = llm.chat(messages, greedy())[0]
    hf_messages = [{"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": "image"},
        {"type": "text", "text": "what is it?"}]}]
    text = tiny_qwen2_vl.processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    assert out.prompt == text
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, [image], MAX_TOKENS)


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": f"{PLACEHOLDER} x", "multi_modal_data": {"image": []}}, "1 image placeholder"),
    ({"prompt": "x", "multi_modal_data": {"image": [None]}}, "0 image placeholder"),
    ({"prompt": f"{PLACEHOLDER}", "multi_modal_data": {"image": "cat.png"}}, "PIL"),
    ({"prompt": f"{PLACEHOLDER}", "multi_modal_data": {"audio": []}}, "multi_modal_data"),
    ({"prompt": f"{PLACEHOLDER}", "multi_modal_data": {"video": []}}, "1 image placeholder"),
    ({"cache_salt": "s"}, "needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompts_raise_value_error(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, greedy())
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("text", ["look <|vision_start|><|video_pad|><|vision_end|> now",
                                  "x <|video_pad|>"])
def test_video_placeholder_without_a_video_is_refused(llm, text):
    """A video placeholder token with no video given (its raw embedding, which the model only
    saw replaced by a video's features) is refused, in a prompt and in a chat message, as a
    stray image placeholder is."""
    with pytest.raises(ValueError, match="1 video placeholder"):
        llm.generate(text, greedy())
    with pytest.raises(ValueError, match="1 video placeholder"):
        llm.chat([{"role": "user", "content": text}], greedy())
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("size,match", [((0, 5), "no pixels"),
                                        ((3000, 10), "aspect ratio"),
                                        ((5000, 20), "aspect ratio")])
def test_images_the_model_cannot_take(llm, size, match):
    image = random_image(*size, seed=0)
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"image": image}}, greedy())


def test_images_smaller_than_a_patch_equal_transformers(llm, tiny_qwen2_vl):
    """transformers resizes an image of any size up to ``min_pixels`` (1 x 1 -> 56 x 56, 4
    placeholder tokens; 5 x 300 -> 28 x 448): they were refused as smaller than one 14-pixel
    patch, which transformers 5 does not ask for."""
    text = f"a {PLACEHOLDER} and {PLACEHOLDER} and {PLACEHOLDER} what?"
    images = [random_image(1, 1, 40), random_image(8, 8, 41), random_image(5, 300, 42)]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy())[0]
    assert out.prompt_token_ids == hf_prompt_ids(tiny_qwen2_vl, text, images)
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)


def test_text_model_refuses_images(tiny_llama):
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="does not take images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": random_image(28, 28, 0)}})
    with pytest.raises(ValueError, match="does not take images"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}],
            chat_template="{{ messages[0]['content'] }}")
    # a video part said "does not take images" only
    with pytest.raises(ValueError, match=r"\(text only: this model does not take images or "
                                         r"videos\)"):
        llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AA=="}}]}],
            chat_template="{{ messages[0]['content'] }}")


def test_async_scheduling_same_tokens(tiny_qwen2_vl, assert_no_leaks):
    """With the next step scheduled while the current one runs (pending sampled tokens read
    on the device), images and M-RoPE positions still line up: transformers' tokens."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=8,
              max_num_batched_tokens=48, async_scheduling=True)
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
    outs = llm.generate(prompts, greedy())
    for (text, images), out in zip(cases(), outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)
    assert_no_leaks(llm)


def test_ngram_speculation_verifies_drafts_at_mrope_positions(tiny_qwen2_vl, assert_no_leaks):
    """N-gram drafts of image prompts are verified several tokens per step, each at its M-RoPE
    position (past an image, text positions run behind the token index): transformers'
    tokens, with drafts accepted."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 1, "adaptive": False})
    text, images = cases()[2]  # two images
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy(12))[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, 12)
    assert out.metrics.num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_image_count_limit_is_checked_before_decoding(tiny_qwen2_vl):
    """Three image parts over a limit of two: refused naming the limit, before any image is
    decoded (the parts' URLs are not even valid images)."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=32, max_images_per_prompt=2)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 3
    with pytest.raises(ValueError, match="3 images in one conversation; the limit is 2"):
        llm.chat([{"role": "user", "content": parts}], greedy())
    assert not llm.engine.has_unfinished_requests()


def test_image_limits_given_are_read(tiny_qwen2_vl):
    """The image limits given to a Qwen2-VL engine take effect: one image per prompt refuses
    two (offline prompt and chat), a pixel limit under an 84 x 56 image refuses it, a byte
    limit under its PNG refuses the data URL; what stays under them generates transformers'
    tokens."""
    image, other = random_image(84, 56, 1), random_image(120, 200, 2)
    size = len(png_bytes(image))
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=64, max_images_per_prompt=1,
              max_image_pixels=84 * 56, max_image_bytes=size, media_fetch_timeout=2.5)
    text = f"{PLACEHOLDER} and {PLACEHOLDER} compare them"
    with pytest.raises(ValueError, match=r"^2 images in one prompt; the limit is 1 "
                                         r"\(--max-images-per-prompt\)$"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [image, image]}}, greedy())
    with pytest.raises(ValueError, match="2 images in one conversation; the limit is 1"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}}] * 2}], greedy())
    one = f"a {PLACEHOLDER} what is this?"
    with pytest.raises(ValueError, match=r"the image is 120 x 200 = 24000 pixels; the limit "
                                         r"is 4704 pixels \(--max-image-pixels\)"):
        llm.generate({"prompt": one, "multi_modal_data": {"image": other}}, greedy())
    with pytest.raises(ValueError, match=rf"the image has {size + 1} bytes; the limit is "
                                         rf"{size} bytes \(--max-image-bytes\)"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": data_url(png_bytes(image) + b"\0")}}]}], greedy())
    assert llm.engine.processor.mm_processor.config.limit("media_fetch_timeout") == 2.5
    out = llm.generate({"prompt": one, "multi_modal_data": {"image": image}}, greedy())[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, one, [image], MAX_TOKENS)
    assert not llm.engine.has_unfinished_requests()


def test_image_limits_left_out_are_the_documented_defaults(llm):
    """Left out (None), the limits are the README's: 20 MiB, 4096 x 4096 pixels, 16 images,
    10 s (the default engine takes the two-image prompts of the other tests)."""
    config = llm.engine.processor.mm_processor.config
    assert [config.limit(name) for name in ("max_image_bytes", "max_image_pixels",
                                            "max_images_per_prompt", "media_fetch_timeout")] \
        == [20 * 1024 * 1024, 16777216, 16, 10.0]


def test_transparent_image_equals_transformers(llm, tiny_qwen2_vl):
    """An RGBA image half transparent: transformers' processor composites it onto white, so
    must kvflow (dropping the alpha channel shows the hidden colours: other tokens)."""
    image = random_image(84, 56, 1).convert("RGBA")
    image.putalpha(Image.fromarray(np.tile(np.array([0, 255], np.uint8), (56, 42))))
    text = f"a {PLACEHOLDER} what is this?"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, greedy())[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, [image], MAX_TOKENS)


def test_embeddings_refuse_images(tiny_qwen2_vl):
    """A Qwen2-VL run with task='embed' pools text like transformers' Qwen2VLModel (last
    token, L2-normalized); images, given as multi_modal_data or as placeholders, are refused
    rather than left out or embedded as placeholder tokens."""
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=32, task="embed")
    text = "the quick brown fox"
    ids = tiny_qwen2_vl.tokenizer.encode(text)
    with torch.no_grad():
        hidden = tiny_qwen2_vl.hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    got = torch.tensor(llm.embed(text)[0].outputs.embedding)
    torch.testing.assert_close(got, hidden / hidden.norm(), atol=2e-5, rtol=1e-4)
    image = random_image(28, 28, 0)
    with pytest.raises(ValueError, match="multi_modal_data: embedding prompts"):
        llm.embed({"prompt": f"{PLACEHOLDER} x", "multi_modal_data": {"image": image}})
    with pytest.raises(ValueError, match="image placeholder token"):
        llm.embed(f"{PLACEHOLDER} x")
    # the video placeholder was embedded as a token (generation refuses it since 78e423f)
    video_id = tiny_qwen2_vl.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for prompt in ("look <|vision_start|><|video_pad|><|vision_end|> now", "x <|video_pad|>"):
        with pytest.raises(ValueError) as e:
            llm.embed(prompt)
        assert str(e.value) == (f"the prompt holds the video placeholder token (id "
                                f"{video_id}), but this input takes no video; remove the "
                                "token from the prompt")
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("detail", ["low", "high"])
def test_chat_refuses_image_detail(llm, detail):
    """``detail`` asks for a resolution kvflow does not choose: refused, as on the server,
    rather than ignored."""
    part = {"type": "image_url",
            "image_url": {"url": data_url(random_image(28, 28, 0)), "detail": detail}}
    with pytest.raises(ValueError, match=f"image_url.detail='{detail}' is not supported"):
        llm.chat([{"role": "user", "content": [part]}], greedy())
    assert not llm.engine.has_unfinished_requests()


def test_lora_adapter_made_by_peft_with_an_image(tiny_qwen2_vl, tmp_path):
    """A PEFT adapter on the decoder names its modules as transformers 5 does
    (``model.language_model.layers.*``): kvflow maps them like the checkpoint's and gives
    peft's greedy tokens for a prompt with an image (they were refused as unknown modules)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    from kvflow.lora.request import LoRARequest

    base = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl.path,
                                                           dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(tmp_path))
    text, images = cases()[1]
    inputs = tiny_qwen2_vl.processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        want = model.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     min_new_tokens=MAX_TOKENS, eos_token_id=None,
                                     pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_lora_rank=4)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, greedy(),
                       lora_request=LoRARequest("vl", 1, str(tmp_path)))[0]
    assert out.outputs[0].token_ids == want
    assert want != hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)  # the adapter acts


@pytest.mark.parametrize("key,value", [("merge_size", 1), ("patch_size", 7),
                                       ("temporal_patch_size", 1)])
def test_image_processor_that_does_not_fit_the_model(tiny_qwen2_vl, tmp_path, key, value):
    """preprocessor_config.json disagreeing with the vision config is refused at start-up
    (it failed inside the engine at the first image: a placeholder count the encoder's rows
    do not match, or patches of the wrong width)."""
    folder = tmp_path / "vl"
    shutil.copytree(tiny_qwen2_vl.path, folder)
    path = folder / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(ValueError, match=f"preprocessor_config.json has {key}={value}"):
        LLM(str(folder), dtype="float32", num_kv_blocks=32)


def test_a_failed_encoder_step_does_not_poison_the_image(llm, tiny_qwen2_vl, monkeypatch,
                                                          assert_no_leaks):
    """The vision encoder raises in the step that encodes an image: its request is aborted.
    The same image afterwards is encoded again and gives transformers' tokens (the scheduler
    kept it as cached, so every later request with it failed on the missing rows)."""
    model = llm.engine.core.executor.runner.mm_runner.model

    def broken(*args, **kwargs):
        raise RuntimeError("simulated encoder failure")

    image = random_image(84, 70, 50)
    prompt = {"prompt": f"a {PLACEHOLDER} b", "multi_modal_data": {"image": image}}
    monkeypatch.setattr(model, "embed_multimodal", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(prompt, greedy())
    monkeypatch.undo()
    out = llm.generate(prompt, greedy())[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, prompt["prompt"], [image],
                                                   MAX_TOKENS)
    assert_no_leaks(llm)


def test_embed_on_a_generation_model_names_the_task(llm):
    """The task is the first thing wrong with embedding images on a generation model."""
    prompt = {"prompt": PLACEHOLDER, "multi_modal_data": {"image": random_image(28, 28, 0)}}
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed(prompt)
