"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``) end to end through the offline API,
against transformers (fp32, CPU).

Oracle: transformers' ``LlavaNextProcessor`` (its PIL any-resolution image processor and
``<image>`` expansion) and ``LlavaNextForConditionalGeneration`` on the same saved tiny
random weights: 32-pixel tiles of 4 x 4 patches, ``image_grid_pinpoints`` 32 x 32, 32 x 64,
64 x 32 and 64 x 64, so the test images pick a 1 x 1, 1 x 2, 2 x 1 and 2 x 2 grid, the
elongated ones with rows or columns cut off by the unpadding. kvflow must expand the
placeholders to the same prompt ids and give the same prompt logprobs and greedy tokens,
for a CLIP tower ("default": its class token dropped) with a Llama decoder and a SigLIP
tower ("full") with a Mistral decoder.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import _randomize_
from tests.multimodal.conftest import (
    LLAVA_CHAT_TEMPLATE,
    LLAVA_IMAGE,
    TinyVL,
    data_url,
    hf_generate,
    hf_prompt_ids,
    random_image,
    saved_tiny_vl,
)

MAX_TOKENS = 4
TILE, PATCH = 32, 8
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def build_tiny_llava_next(folder: str, tiny_tokenizer, vision: dict, text: dict, seed: int,
                          **fields) -> TinyVL:
    """A tiny random LlavaNextForConditionalGeneration saved with transformers' PIL
    LLaVA-NeXT image processor, and the ``LlavaNextProcessor`` the HF side runs."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
            **text}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
              "num_attention_heads": 2, "patch_size": PATCH, "image_size": TILE, **vision}
    config = LlavaNextConfig(vision_config=vision, text_config=text,
                             image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE),
                             image_grid_pinpoints=PINPOINTS, **fields)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_(model, seed=seed)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS)
    clip = vision["model_type"] == "clip_vision_model"
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
        chat_template=LLAVA_CHAT_TEMPLATE,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=int(clip))
    return saved_tiny_vl(folder, model, processor, tokenizer, image_processor,
                         config.image_token_index)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    """llava-v1.6-vicuna's shape: a CLIP tower read at layer -2 without its class token
    ("default"), a Llama decoder."""
    return build_tiny_llava_next(str(tmp_path_factory.mktemp("tiny_llava_next")),
                                 tiny_tokenizer, {"model_type": "clip_vision_model",
                                                  "hidden_act": "quick_gelu"},
                                 {"model_type": "llama"}, seed=23)


@pytest.fixture(scope="module")
def tiny_siglip(tmp_path_factory, tiny_tokenizer) -> TinyVL:
    """A SigLIP tower read at layer 1 with every token ("full"), a projector without
    biases, a Mistral decoder (sliding window 8)."""
    return build_tiny_llava_next(str(tmp_path_factory.mktemp("tiny_llava_next_siglip")),
                                 tiny_tokenizer, {"model_type": "siglip_vision_model",
                                                  "hidden_act": "gelu_pytorch_tanh"},
                                 {"model_type": "mistral", "sliding_window": 8}, seed=29,
                                 vision_feature_layer=1, vision_feature_select_strategy="full",
                                 multimodal_projector_bias=False)


@pytest.fixture(scope="module", params=["clip_llama", "siglip_mistral"])
def tiny(request) -> TinyVL:
    return request.getfixturevalue("tiny_clip" if request.param == "clip_llama"
                                   else "tiny_siglip")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny.path, dtype="float32", num_kv_blocks=128, block_size=16)


def images():
    """(width, height) -> grid: 20 x 20 -> 1 x 1; 120 x 40 -> 1 x 2, unpadded to 2 of its
    4 patch rows; 30 x 100 -> 2 x 1, unpadded to 2 of 4 patch columns; 60 x 60 -> 2 x 2."""
    return [random_image(w, h, seed) for seed, (w, h) in
            enumerate([(20, 20), (120, 40), (30, 100), (60, 60)])]


def cases():
    """(text, images): 0, 1 and 2 images."""
    small, wide, tall, square = images()
    return [("USER: the quick brown fox ASSISTANT:", []),
            (f"USER: {LLAVA_IMAGE}\nwhat is this? ASSISTANT:", [wide]),
            (f"USER: {LLAVA_IMAGE} and {LLAVA_IMAGE} compare ASSISTANT:", [tall, square]),
            (f"USER: {LLAVA_IMAGE}\nsmall ASSISTANT:", [small])]


def test_placeholder_counts_equal_transformers(llm, tiny):
    """The expanded prompt is transformers' for every grid; the counts by hand: 16 base
    tokens + H' * (W' + 1) for the unpadded H' x W' map and its newlines."""
    counts = []
    for image in images():
        text = f"USER: {LLAVA_IMAGE} ASSISTANT:"
        processed = llm.engine.processor.process(
            {"prompt": text, "multi_modal_data": {"image": [image]}})
        assert processed.token_ids == hf_prompt_ids(tiny, text, [image])
        (feature,) = processed.mm_features
        counts.append(feature.length)
    assert counts == [16 + 4 * 5, 16 + 2 * 9, 16 + 8 * 3, 16 + 8 * 9]
    # extreme and off-by-one shapes: 300 x 2 keeps no row of its grid (the base tile only)
    for width, height in [(300, 2), (2, 300), (1, 1), (65, 33), (40, 41)]:
        image = random_image(width, height, 5)
        processed = llm.engine.processor.process(
            {"prompt": LLAVA_IMAGE, "multi_modal_data": {"image": [image]}})
        assert processed.token_ids == hf_prompt_ids(tiny, LLAVA_IMAGE, [image])


def hf_prompt_logprobs(tiny, inputs) -> list[float]:
    """transformers' logprob of each prompt token 1..n-1 given the ones before it."""
    with torch.no_grad():
        logits = tiny.hf_model(**inputs).logits[0]
    ids = inputs["input_ids"][0]
    return torch.log_softmax(logits[:-1].float(), -1).gather(
        1, ids[1:, None])[:, 0].tolist()


def test_prompt_logprobs_and_greedy_tokens_equal_transformers(llm, tiny, assert_no_leaks):
    _assert_batch_equals_transformers(llm, tiny, cases())  # different grids, image counts
    assert_no_leaks(llm)


def _assert_batch_equals_transformers(llm, tiny, prompts) -> None:
    """``prompts`` ((text, images) pairs) generated in one batch: the prompt ids, prompt
    logprobs and greedy tokens are transformers' (processor, forward pass, generate)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=0)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}}
                         for t, imgs in prompts], params)
    for (text, imgs), out in zip(prompts, outs):
        inputs = tiny.processor(text=[text], images=imgs or None, return_tensors="pt")
        ids = out.prompt_token_ids
        assert ids == inputs["input_ids"][0].tolist()
        got = [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i]
        np.testing.assert_allclose(got, hf_prompt_logprobs(tiny, inputs), atol=2e-4)
        assert out.outputs[0].token_ids == hf_generate(tiny, text, imgs, MAX_TOKENS)


def test_chat_with_image_url(llm, tiny):
    image = random_image(70, 30, 40)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is it?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            ignore_eos=True))[0]
    text = tiny.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True)
    assert out.prompt == text
    assert out.outputs[0].token_ids == hf_generate(tiny, text, [image], MAX_TOKENS)


def test_in_memory_checkpoint_names_map_to_parameters(llm, tiny):
    """transformers 5's module names (``model.image_newline``, ``model.vision_tower.*``,
    ...) name kvflow's parameters for the tower, the projector and ``image_newline``."""
    model = llm.engine.core.executor.worker.runner.model
    own = {n for n, _ in model.named_parameters() if n.startswith(model.own_prefixes)}
    names = {model.checkpoint_name(n) for n in tiny.hf_model.state_dict()}
    tower = "vision_tower."
    wanted = {n for n in names if n.startswith(model.own_prefixes) and not
              (n.startswith(tower) and not model.vision_tower.needs(n[len(tower):]))}
    assert "image_newline" in own and wanted == own


@pytest.mark.parametrize("override,match", [
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
    ({"image_grid_pinpoints": [[32, 48]]}, "image_grid_pinpoints"),
    ({"vision_feature_layer": []}, "vision_feature_layer"),
])
def test_configs_kvflow_cannot_pack_are_refused(tiny_clip, override, match):
    """"full" would keep CLIP's class token in every tile; 48 pixels is no whole number of
    32-pixel tiles; an empty list of feature layers names none."""
    with pytest.raises(ValueError, match=match):
        LLM(tiny_clip.path, dtype="float32", num_kv_blocks=64, hf_overrides=override)


def test_a_list_of_feature_layers_equals_transformers(tmp_path, tiny_tokenizer,
                                                      assert_no_leaks):
    """``vision_feature_layer`` a list: every tile's hidden states of those layers,
    concatenated (the projector 3 x the tower's width), then packed; was refused at load."""
    tiny = build_tiny_llava_next(str(tmp_path), tiny_tokenizer,
                                 {"model_type": "clip_vision_model", "hidden_act": "quick_gelu"},
                                 {"model_type": "llama"}, seed=37,
                                 vision_feature_layer=[-1, 0, -3])
    llm = LLM(tiny.path, dtype="float32", num_kv_blocks=128, block_size=16)
    _assert_batch_equals_transformers(llm, tiny, cases()[1:])
    assert_no_leaks(llm)


def test_image_processor_with_other_pinpoints_is_refused(tiny_clip, tmp_path):
    """preprocessor_config.json tiling by other resolutions than config.json packs: refused
    when the model loads, not a shape error at the first image."""
    shutil.copytree(tiny_clip.path, tmp_path / "m")
    conf_file = tmp_path / "m" / "preprocessor_config.json"
    conf = json.loads(conf_file.read_text())
    conf["image_grid_pinpoints"] = [[32, 32], [64, 64]]
    conf_file.write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        LLM(str(tmp_path / "m"), dtype="float32", num_kv_blocks=64)


def test_llava_v1_6_shaped_config_counts_like_transformers(tmp_path, tiny_tokenizer):
    """A config.json of llava-hf/llava-v1.6-mistral-7b-hf's shape (336-pixel CLIP tiles of
    14-pixel patches, its five pinpoints up to 672 x 672 and 1008 x 336, a Mistral decoder
    whose text_config names few sizes): it reads as a multimodal model, and its placeholder
    counts are transformers' LlavaNextProcessor's for photos of several shapes (2928 for a
    square one: 576 base + 48 x 49)."""
    from types import SimpleNamespace

    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    from kvflow.models.llava_next_packing import llava_next_image_tokens
    from kvflow.models.loader import load_hf_config
    from kvflow.models.registry import is_multimodal

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next",
        "image_grid_pinpoints": pinpoints, "image_token_index": 32000,
        "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "text_config": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                        "intermediate_size": 14336, "max_position_embeddings": 32768,
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                        "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                          "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "vocab_size": 32064}))
    config = load_hf_config(SimpleNamespace(kind="hf", path=str(tmp_path)))
    assert is_multimodal(config) and config.image_grid_pinpoints == pinpoints
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE]})
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
            image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    sizes = [(480, 640), (640, 480), (1000, 300), (300, 1000), (500, 500), (2000, 1999),
             (100, 90), (337, 1500)]
    want = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [llava_next_image_tokens(config, s) for s in sizes] == want
    assert llava_next_image_tokens(config, (500, 500)) == 576 + 48 * 49


def test_videos_are_refused(llm):
    """LLaVA-NeXT takes no videos (its config has no video token): a ValueError saying so,
    and the engine keeps no request."""
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "x", "multi_modal_data": {
            "video": np.zeros((2, 32, 32, 3), np.uint8)}})
    assert not llm.engine.has_unfinished_requests()
