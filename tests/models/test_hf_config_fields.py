"""config.json fields that transformers reads leniently (a warning, or nothing) are one
``ValueError`` naming the file, the field and its value, before any weight loads.

Before (the tiny Llama, hidden 64): a linear RoPE ``factor`` of 0 only made transformers log
"factor field must be a float or int >= 1" and kvflow generated one constant token; an
``rms_norm_eps`` of -1 generated token 0 over and over (NaN logits); a ``sliding_window`` of -3
loaded and changed the output; ``architectures: "LlamaForCausalLM"`` (a string) was
"unsupported model architecture LlamaForCausalLM; kvflow supports [..., 'LlamaForCausalLM',
...]"; ``quantization_config: "fp8"`` was "'str' object has no attribute 'to_dict'"; and an
empty ``quantization_config`` loaded as float weights without a word."""

from __future__ import annotations

import json
import os

import pytest

from kvflow import LLM, SamplingParams
from tests.folder_edits import copy_with_json


def _edited(tiny, folder, **changes) -> str:
    """A copy of the tiny model's folder with ``changes`` set in its config.json; returns the
    config.json path."""
    return copy_with_json(tiny.path, folder, **changes)


def _llm(config_path: str) -> LLM:
    return LLM(model=os.path.dirname(config_path), dtype="float32", device="cpu",
               num_kv_blocks=16, block_size=4)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": "LlamaForCausalLM"},
     ("architectures='LlamaForCausalLM' is invalid; it must be a list of model class names, "
     'e.g. ["LlamaForCausalLM"]')),
    ({"architectures": [7]}, ("architectures=[7] is invalid; it must be a list of model class "
     'names, e.g. ["LlamaForCausalLM"]')),
    ({"quantization_config": "fp8"},
     ("quantization_config='fp8' is invalid; it must be an object naming its \"quant_method\" "
     "(kvflow reads 'compressed-tensors', 'gptq', 'awq' and block-wise 'fp8'), or be left "
     "out for float "
     "weights")),
    ({"quantization_config": {}},
     ("quantization_config={} is invalid; it must be an object naming its \"quant_method\" "
     "(kvflow reads 'compressed-tensors', 'gptq', 'awq' and block-wise 'fp8'), or be left "
     "out for float "
     "weights")),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 is invalid; it must be a number >= 0"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' is invalid; it must be a number >= 0"),
    ({"sliding_window": -3}, ("sliding_window=-3 is invalid; it must be a positive integer "
     "(tokens), or null for full attention")),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0}},
     ("rope_parameters.factor=0.0 is invalid for rope_type 'linear'; it must be a number >= 1 "
     "(how many times the original context the scaled RoPE covers)")),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 0.5, "rope_theta": 10000.0}},
     ("rope_parameters.factor=0.5 is invalid for rope_type 'dynamic'; it must be a number >= 1 "
     "(how many times the original context the scaled RoPE covers)")),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}},
     "rope_parameters.rope_theta=-5.0 is invalid; it must be a number > 0 (the RoPE base)"),
    # was torch's "can't allocate memory: you tried to allocate 1125899906842624 bytes" for
    # the rotary table of 256 x 2**40 positions
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0**40, "rope_theta": 10000.0}},
     ("the RoPE scaling covers 281474976710656 positions (max_position_embeddings=256 with "
      "its rope_parameters factor), above the 16777216 positions kvflow tables (is the factor "
      "right?)")),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0**40, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 64}},
     ("the RoPE scaling covers 70368744177664 positions (max_position_embeddings=256 with its "
      "rope_parameters factor), above the 16777216 positions kvflow tables (is the factor "
      "right?)")),
], ids=["architectures_string", "architectures_not_names", "quantization_config_string",
        "quantization_config_empty", "negative_eps", "string_eps", "negative_window",
        "zero_linear_factor", "dynamic_factor_below_1", "negative_theta",
        "linear_factor_2e40", "yarn_factor_2e40"])
def test_bad_field_is_named(tiny_llama, tmp_path, changes, message):
    config_path = _edited(tiny_llama, tmp_path / "model", **changes)
    with pytest.raises(ValueError) as info:
        _llm(config_path)
    assert str(info.value) == f"model config {config_path!r}: {message}"


def test_older_rope_scaling_field_is_checked_too(tiny_llama, tmp_path):
    """A transformers 4 ``rope_scaling`` dict (transformers 5 moves it into
    ``rope_parameters``) with a factor below 1."""
    config_path = _edited(tiny_llama, tmp_path / "model", rope_scaling={
        "type": "linear", "factor": -2}, rope_theta=10000.0)
    with open(config_path) as f:
        edited = json.load(f)
    del edited["rope_parameters"]  # what the tiny model's save wrote
    with open(config_path, "w") as f:
        json.dump(edited, f)
    with pytest.raises(ValueError, match=r"\.factor=-2 is invalid for rope_type 'linear'"):
        _llm(config_path)


def test_window_that_does_not_apply_and_neutral_values_load(tiny_llama, tmp_path):
    """A window turned off by ``use_sliding_window: false`` (Qwen2's configs), an epsilon of
    0 and a factor of exactly 1 are accepted, and generate what the unedited model does."""
    config_path = _edited(tiny_llama, tmp_path / "model", sliding_window=-3,
                          use_sliding_window=False, rms_norm_eps=tiny_llama.hf_model.config
                          .rms_norm_eps, rope_parameters={"rope_type": "linear", "factor": 1.0,
                                                          "rope_theta": 10000.0})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    got = _llm(config_path).generate(prompt, params)[0].outputs[0].token_ids
    want = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16,
               block_size=4).generate(prompt, params)[0].outputs[0].token_ids
    assert got == want


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_longrope_per_layer_type_is_refused(tiny_model_factory, tmp_path, layer_type):
    """Gemma 3's per-layer-type rope_parameters with LongRoPE on one layer type: transformers
    rotates a prompt longer than the original context with the long factors at every position
    of those layers; kvflow's long-prompt rows cover a model-wide LongRoPE only, and loaded
    this config to rotate such a prompt's first positions with the short factors (a prompt of
    700 tokens, original 256: prompt logprobs off by up to 3.6 nats from transformers')."""
    tiny = tiny_model_factory("gemma3")
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    rope[layer_type] = {"rope_type": "longrope", "rope_theta": 10000.0,
                        "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                        "original_max_position_embeddings": 64}
    config_path = _edited(tiny, tmp_path / "model", rope_parameters=rope)
    with pytest.raises(ValueError) as info:
        _llm(config_path)
    assert str(info.value) == (
        f"model config {config_path!r}: rope_parameters[{layer_type!r}].rope_type='longrope' "
        "is not supported per layer type: transformers rotates a prompt longer than "
        "original_max_position_embeddings with the long factors at every position, which "
        "kvflow does only for one model-wide LongRoPE (long prompts would run with the short "
        "factors)")


_ROPE_TYPES = "default, linear, llama3, longrope, su, yarn, dynamic"


@pytest.mark.parametrize("rope, field", [
    ({"rope_parameters": {"rope_type": "foo", "rope_theta": 10000.0}},
     "rope_parameters.rope_type='foo'"),
    ({"rope_scaling": {"type": "foo", "factor": 2.0}, "rope_theta": 10000.0},
     "rope_scaling.type='foo'"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}, "rope_theta": 10000.0},
     "rope_scaling.rope_type='proportional'"),
], ids=["rope_parameters", "older_rope_scaling_type", "transformers_type_kvflow_lacks"])
def test_unknown_rope_type_names_the_file_and_field(tiny_llama, tmp_path, rope, field):
    """It was "unsupported rope_type 'foo': kvflow supports ..." from the model's build, not
    saying where the value came from (transformers only logs "Missing validation function"
    for it)."""
    config_path = _edited(tiny_llama, tmp_path / "model", **rope)
    if "rope_scaling" in rope:
        with open(config_path) as f:
            edited = json.load(f)
        del edited["rope_parameters"]  # what the tiny model's save wrote
        with open(config_path, "w") as f:
            json.dump(edited, f)
    with pytest.raises(ValueError) as info:
        _llm(config_path)
    assert str(info.value) == (f"model config {config_path!r}: {field} is not supported; "
                               f"kvflow's RoPE implements {_ROPE_TYPES}")


def test_unknown_rope_type_per_layer_type_is_named(tiny_model_factory, tmp_path):
    tiny = tiny_model_factory("gemma3")
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "foo", "rope_theta": 10000.0}}
    config_path = _edited(tiny, tmp_path / "model", rope_parameters=rope)
    with pytest.raises(ValueError) as info:
        _llm(config_path)
    assert str(info.value) == (
        f"model config {config_path!r}: rope_parameters['sliding_attention'].rope_type='foo' "
        f"is not supported; kvflow's RoPE implements {_ROPE_TYPES}")
