"""LLaVA (``LlavaForConditionalGeneration``) end to end through the offline API, against
transformers (fp32, CPU).

Oracle: transformers' ``LlavaProcessor`` (PIL CLIP / SigLIP image processor, ``<image>``
expansion) and ``LlavaForConditionalGeneration`` on the same saved tiny random weights.
kvflow must expand the placeholders to the same prompt ids and give the same greedy tokens
and logprobs for prompts with 0, 1 and 2 images in one batch, for LLaVA-1.5's shape (CLIP
tower at layer -2, "default" strategy, Llama decoder) and the other one (SigLIP at layer 1,
"full", no projector biases, Mistral decoder with a sliding window); the weights load from
transformers 5's and the older checkpoint naming alike; config fields kvflow does not
compute are refused naming them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import (
    LLAVA_IMAGE,
    _tiny_llava,
    data_url,
    hf_generate,
    hf_prompt_ids,
    random_image,
)

MAX_TOKENS = 6
TOP = 3


def greedy(n: int = MAX_TOKENS, logprobs: int | None = TOP) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def cases():
    """(text, images): 0, 1 and 2 images of different sizes and aspect ratios."""
    a, b, c = random_image(84, 56, 1), random_image(120, 200, 2), random_image(300, 90, 3)
    return [
        ("USER: the quick brown fox jumps over ASSISTANT:", []),
        (f"USER: {LLAVA_IMAGE}\nwhat is this? ASSISTANT:", [a]),
        (f"USER: {LLAVA_IMAGE} and {LLAVA_IMAGE} compare them ASSISTANT:", [b, c]),
    ]


def hf_reference(tiny, text: str, images: list) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and its log-softmax over the vocabulary at each step
    (``generate``'s raw logits: a generated token may be ``<image>`` itself, which a second
    forward pass over prompt + tokens would take for a placeholder)."""
    inputs = tiny.processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     min_new_tokens=MAX_TOKENS, eos_token_id=None,
                                     pad_token_id=0, output_logits=True,
                                     return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


@pytest.fixture(scope="module", params=["clip_llama", "siglip_mistral"])
def tiny(request):
    name = "tiny_llava" if request.param == "clip_llama" else "tiny_llava_siglip"
    return request.getfixturevalue(name)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny.path, dtype="float32", num_kv_blocks=128, block_size=16)


def test_prompt_ids_expand_like_transformers(llm, tiny):
    for text, images in cases():
        processed = llm.engine.processor.process(
            {"prompt": text, "multi_modal_data": {"image": images}})
        assert processed.token_ids == hf_prompt_ids(tiny, text, images)
        assert len(processed.mm_features or []) == len(images)
    # 16 patches; "default" drops CLIP's class token, "full" keeps all SigLIP's 16
    (feature,) = llm.engine.processor.process(
        {"prompt": LLAVA_IMAGE, "multi_modal_data": {"image": cases()[1][1]}}).mm_features
    assert feature.length == 16


def test_greedy_tokens_and_logprobs_equal_transformers(llm, tiny, assert_no_leaks):
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
    outs = llm.generate(prompts, greedy())  # one batch, different prompts and image counts
    for (text, images), out in zip(cases(), outs):
        tokens = out.outputs[0].token_ids
        ref_tokens, ref_logprobs = hf_reference(tiny, text, images)
        assert tokens == ref_tokens
        for step, (token, ref) in enumerate(zip(tokens, ref_logprobs, strict=True)):
            got = out.outputs[0].logprobs[step]
            assert set(got) == set(ref.topk(TOP).indices.tolist()) | {token}
            for tid, lp in got.items():
                assert lp.logprob == pytest.approx(ref[tid].item(), abs=2e-4)
    assert_no_leaks(llm)


def test_chat_with_image_url(llm, tiny):
    image = random_image(70, 140, 30)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is it?"}]}]
    out = llm.chat(messages, greedy(logprobs=None))[0]
    text = tiny.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True)
    assert out.prompt == text
    assert out.outputs[0].token_ids == hf_generate(tiny, text, [image], MAX_TOKENS)


def _renamed_copy(tiny, folder, rename) -> str:
    """A copy of the tiny model folder with every checkpoint tensor name passed through
    ``rename``."""
    shutil.copytree(tiny.path, folder)
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, file,
              metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("layout", ["hub_4x", "in_memory_5x"])
def test_both_checkpoint_namings_load(tiny_llava, tmp_path, layout):
    """transformers 5 saves ``language_model.model.*`` / ``vision_tower.embeddings.*``; the
    llava-hf checkpoints hold ``vision_tower.vision_model.*``, transformers 5's modules are
    ``model.language_model.*`` / ``model.vision_tower.*``: the same tokens from each."""
    def hub(name: str) -> str:
        return name.replace("vision_tower.", "vision_tower.vision_model.", 1)

    def in_memory(name: str) -> str:
        for old, new in (("language_model.model.", "model.language_model."),
                         ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        raise AssertionError(name)

    with open(os.path.join(tiny_llava.path, "model.safetensors"), "rb") as f:
        assert b"language_model.model.layers" in f.read(1 << 16)  # what the copy renames
    path = _renamed_copy(tiny_llava, tmp_path / layout,
                         hub if layout == "hub_4x" else in_memory)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
    text, images = cases()[1]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                       greedy(logprobs=None))[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_llava, text, images, MAX_TOKENS)


def test_unknown_tensor_is_refused(tiny_llava, tmp_path):
    path = _renamed_copy(tiny_llava, tmp_path / "bad",
                         lambda n: n.replace("linear_2", "linear_3"))
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_3\."):
        LLM(path, dtype="float32", num_kv_blocks=64)


@pytest.mark.parametrize("override,match", [
    ({"vision_feature_layer": []}, "vision_feature_layer"),
    ({"vision_feature_layer": [-2, 1.5]}, "vision_feature_layer"),
    ({"vision_feature_layer": [-2, 9]}, "outside the vision encoder"),
    ({"image_grid_pinpoints": [[336, 672]]}, "image_grid_pinpoints"),
    ({"vision_config": {"model_type": "pixtral", "hidden_size": 32}}, "vision_config"),
])
def test_fields_kvflow_does_not_compute_are_refused(tiny_llava, override, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64, hf_overrides=override)


@pytest.mark.parametrize("tower,layers,strategy", [
    ("clip_vision_model", [-2, 0, 3], "default"), ("siglip_vision_model", [1, -1], "full")])
def test_a_list_of_feature_layers_equals_transformers(tmp_path, tiny_tokenizer, tower, layers,
                                                      strategy, assert_no_leaks):
    """``vision_feature_layer`` a list (transformers concatenates those layers' hidden
    states, the projector taking len(list) x the tower's width) was refused at load; now the
    same prompt ids, greedy tokens and logprobs as transformers."""
    act = "quick_gelu" if tower == "clip_vision_model" else "gelu_pytorch_tanh"
    tiny = _tiny_llava(str(tmp_path), tiny_tokenizer, {"model_type": tower, "hidden_act": act},
                       {"model_type": "llama"}, seed=31, vision_feature_layer=layers,
                       vision_feature_select_strategy=strategy)
    assert tiny.hf_model.model.multi_modal_projector.linear_1.in_features == 32 * len(layers)
    llm = LLM(tiny.path, dtype="float32", num_kv_blocks=64, block_size=16)
    _, one, two = cases()
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}}
                         for t, imgs in (one, two)], greedy())
    for (text, images), out in zip((one, two), outs):
        assert out.prompt_token_ids == hf_prompt_ids(tiny, text, images)
        ref_tokens, ref_logprobs = hf_reference(tiny, text, images)
        assert out.outputs[0].token_ids == ref_tokens
        for step, token in enumerate(ref_tokens):
            got = out.outputs[0].logprobs[step][token].logprob
            assert got == pytest.approx(ref_logprobs[step][token].item(), abs=2e-4)
    assert_no_leaks(llm)


def test_wrong_image_processor_size_is_refused(tiny_llava, tmp_path):
    """A preprocessor_config.json cropping to another size than the tower's image_size: a
    ValueError naming both files, not a shape error inside the engine."""
    path = tmp_path / "crop"
    shutil.copytree(tiny_llava.path, path)
    conf_file = path / "preprocessor_config.json"
    conf = json.loads(conf_file.read_text())
    conf["crop_size"] = {"height": 42, "width": 42}
    conf_file.write_text(json.dumps(conf))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="42 x 42 image.*56 x 56"):
        llm.generate({"prompt": LLAVA_IMAGE, "multi_modal_data": {"image": cases()[1][1]}})
    assert not llm.engine.has_unfinished_requests()


def test_llava_hf_template_gets_content_parts():
    """llava-hf's template loops over ``message['content'] | selectattr(...)`` and uses the
    ``{% generation %}`` tag: it is given the parts (images as ``{"type": "image"}``), as
    vLLM's "openai" content format detection finds it; a template that only prints the
    content is given text."""
    from kvflow.chat.template import loops_over_content
    from tests.multimodal.conftest import LLAVA_CHAT_TEMPLATE

    assert loops_over_content(LLAVA_CHAT_TEMPLATE)
    assert not loops_over_content("{% for m in messages %}{{ m['content'] | trim }}"
                                  "{% endfor %}")


def test_processor_chat_template_json_is_read(tiny_llava, tmp_path):
    """llava-hf folders keep the chat template in the processor's chat_template.json, which
    the tokenizer does not read: it is the model's template, as in vLLM."""
    path = tmp_path / "json_template"
    shutil.copytree(tiny_llava.path, path)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    for name in ("tokenizer_config.json",):  # no template left anywhere else
        conf = json.loads((path / name).read_text())
        assert "chat_template" not in conf
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    image = random_image(50, 80, 4)
    out = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "and this?"},
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}],
        greedy(logprobs=None))[0]
    assert out.prompt == f"USER: {LLAVA_IMAGE}\nand this? ASSISTANT:"
    assert out.outputs[0].token_ids == hf_generate(tiny_llava, out.prompt, [image], MAX_TOKENS)


@pytest.mark.distributed_slow
@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                    reason="slow: run scripts/test_distributed_slow.sh")
def test_tensor_parallel_greedy_tokens_equal_transformers(tiny_llava):
    """TP=2 over 2 worker processes (gloo on CPU): the decoder split, the vision tower and
    projector replicated on both ranks. In scripts/test_distributed_slow.sh (~11 s): the
    default suite keeps Qwen2-VL's TP=2 case (tests/multimodal/test_qwen2_vl_parallel.py: the
    same split decoder with a replicated tower and image rows merged into the prompt)."""
    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=128, block_size=16,
              tensor_parallel_size=2)
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
        outs = llm.generate(prompts, greedy(logprobs=None), use_tqdm=False)
    finally:
        llm.shutdown()
    for (text, images), out in zip(cases(), outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_llava, text, images, MAX_TOKENS)


def test_videos_are_refused(tiny_llava):
    """LLaVA-1.5 takes no videos: a video in ``multi_modal_data`` or a ``video_url`` chat
    part is a ValueError saying so."""
    import numpy as np

    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "x", "multi_modal_data": {
            "video": np.zeros((2, 56, 56, 3), np.uint8)}})
    with pytest.raises(ValueError, match="video_url"):
        llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AA=="}}]}])
    assert not llm.engine.has_unfinished_requests()


def test_llava_1_5_config_json_reads(tmp_path):
    """llava-hf/llava-1.5-7b-hf's config.json (as published: its text_config names no sizes,
    which come from LlamaConfig's defaults as transformers builds it, and vocab_size is
    repeated at the top level): a 4096-wide, 32-layer decoder, 576 placeholder tokens per
    336-pixel image, a 23-layer tower (layer -2 of 24)."""
    from types import SimpleNamespace

    from kvflow.models.clip_vision import VisionTower
    from kvflow.models.loader import load_hf_config
    from kvflow.models.registry import is_multimodal

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100,
        "image_token_index": 32000, "model_type": "llava", "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5",
                        "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama",
                        "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.36.0.dev0",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                          "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "vocab_size": 32064}))
    config = load_hf_config(SimpleNamespace(kind="hf", path=str(tmp_path)))
    assert is_multimodal(config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.vocab_size, config.image_token_id) == (4096, 32, 32, 32064, 32000)
    from kvflow.models.llava import llava_image_tokens

    assert llava_image_tokens(config, (1, 24, 24)) == 576
    with torch.device("meta"):
        tower = VisionTower(config.vision_config, config.vision_feature_layer)
    assert len(tower.encoder.layers) == 23
    assert tower.embeddings.position_embedding.weight.shape == (577, 1024)


def test_image_keys_the_prefix_cache_and_encoder_cache(tiny_llava):
    """Same text with another image: only the full blocks before the image are reused,
    transformers' tokens for each; the same image again: its blocks hit too, and it is not
    encoded again."""
    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64, block_size=4)
    text = f"USER: {LLAVA_IMAGE}\ndescribe the picture please ASSISTANT:"
    one, two = random_image(64, 64, 10), random_image(64, 64, 11)
    kv, encoder = llm.engine.core.kv_cache_manager, llm.engine.core.scheduler.encoder

    def run(image):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": image}},
                            greedy(logprobs=None))[0].outputs[0].token_ids

    (feature,) = llm.engine.processor.process(
        {"prompt": text, "multi_modal_data": {"image": one}}).mm_features
    before_image = feature.offset // 4 * 4  # tokens of the full blocks before the image
    assert before_image > 0
    first = run(one)
    hits, encoded = kv.num_hits, encoder.num_encoded
    second = run(two)
    assert kv.num_hits - hits == before_image and encoder.num_encoded == encoded + 1
    assert first == hf_generate(tiny_llava, text, [one], MAX_TOKENS)
    assert second == hf_generate(tiny_llava, text, [two], MAX_TOKENS)
    assert first != second
    hits = kv.num_hits
    assert run(one) == first
    assert kv.num_hits - hits > feature.end  # past the image's placeholders
    assert encoder.num_encoded == encoded + 1


@pytest.mark.parametrize("targets,part", [(["q_proj", "v_proj"], "vision_tower"),
                                          (["linear_1"], "multi_modal_projector")])
def test_lora_adapter_of_the_vision_tower_is_refused_naming_it(tiny_llava, tmp_path, targets,
                                                                part):
    """peft adapts every module ``target_modules`` names, the CLIP tower's q/v_proj and the
    projector's linear_1 too; kvflow adapts the language model only, so such an adapter is
    refused at load naming the part and what to train instead (the tower's q_proj was
    refused as a module "this model has no (an adapter for another base model?)")."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    from kvflow.lora.request import LoRARequest

    base = LlavaForConditionalGeneration.from_pretrained(tiny_llava.path, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets)).save_pretrained(
        str(tmp_path))
    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64, block_size=16,
              enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=rf"in the model's '{part}' \(the vision tower or its "
                       r"projector\): kvflow applies LoRA adapters to the language model only"):
        llm.engine.core.add_lora(LoRARequest("tower", 1, str(tmp_path)))
