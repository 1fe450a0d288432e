"""``--hf-overrides`` / ``LLM(hf_overrides=...)`` (vLLM's flag): a JSON object merged into
config.json before kvflow checks and reads it. The merge rule (top-level keys replace, an
object for a nested config merges into it) against hand-written expected dicts; bad values
refused naming the flag (Python, CLI, config file); a merged field the config checks refuse
named with the overrides; and a merged ``sliding_window`` that changes the model's output,
against transformers built with the same window (and told apart from the file's own)."""

from __future__ import annotations

import dataclasses

import pytest

from kvflow import LLM
from kvflow.config import EngineConfig
from kvflow.config.model import ModelConfig
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.config_file import expand_config_file
from kvflow.models.hf_overrides import merge_hf_overrides
from tests.models.test_parity import _prompts, assert_matches_hf, greedy, hf_greedy


def test_top_level_keys_replace_and_nested_configs_merge():
    raw = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
           "text_config": {"hidden_size": 64, "rope_parameters": {"rope_theta": 1e6,
                                                                  "mrope_section": [2, 2]}},
           "vision_config": {"depth": 2}}
    overrides = {"architectures": ["X"], "rope_scaling": {"factor": 2.0}, "new_key": [1],
                 "text_config": {"num_labels": 1, "rope_parameters": {"rope_theta": 5.0}},
                 "vision_config": 7}
    merged = merge_hf_overrides(raw, overrides)
    assert merged == {
        "model_type": "qwen2_vl", "architectures": ["X"],
        "rope_scaling": {"factor": 2.0},  # not a nested config: replaced whole, as vLLM sets it
        "text_config": {"hidden_size": 64, "num_labels": 1,
                        "rope_parameters": {"rope_theta": 5.0, "mrope_section": [2, 2]}},
        "vision_config": 7, "new_key": [1]}
    assert raw["text_config"]["rope_parameters"]["rope_theta"] == 1e6  # the input is kept
    # a model type without nested configs: an object replaces a dict-valued key
    assert merge_hf_overrides({"model_type": "qwen3", "text_config": {"a": 1, "b": 2}},
                              {"text_config": {"a": 3}}) == \
        {"model_type": "qwen3", "text_config": {"a": 3}}


NOT_AN_OBJECT = "--hf-overrides (hf_overrides) must be a JSON object of config.json keys, got "


@pytest.mark.parametrize("value, message", [
    ("{bad", ("--hf-overrides (hf_overrides) is not valid JSON: Expecting property name "
              "enclosed in double quotes: line 1 column 2 (char 1)")),
    ('["architectures"]', NOT_AN_OBJECT + '["architectures"] (list)'),
    ('"x"', NOT_AN_OBJECT + '"x" (str)'),
    (3, NOT_AN_OBJECT + "3 (int)"),
])
def test_bad_values_name_the_flag(value, message):
    with pytest.raises(ValueError) as e:
        ModelConfig(model="m", hf_overrides=value)
    assert str(e.value).startswith(message), str(e.value)


def test_empty_or_null_overrides_are_none():
    for value in (None, "null", "{}", {}, " {} "):
        assert ModelConfig(model="m", hf_overrides=value).hf_overrides is None
    assert ModelConfig(model="m", hf_overrides='{"a": {"b": 1}}').hf_overrides == \
        {"a": {"b": 1}}


def test_cli_flag_and_config_file(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "--hf-overrides", '{"sliding_window": 4}'])
    assert EngineConfig.from_cli_args(args).model_config.hf_overrides == {"sliding_window": 4}
    path = tmp_path / "engine.yaml"
    path.write_text("hf-overrides:\n  architectures: [Qwen3ForSequenceClassification]\n"
                    "  is_original_qwen3_reranker: true\n")
    args = parser.parse_args(expand_config_file(parser, ["generate", "--config", str(path)]))
    assert EngineConfig.from_cli_args(args).model_config.hf_overrides == {
        "architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True}
    assert main(["generate", "--hf-overrides", "[1]", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert NOT_AN_OBJECT + "[1] (list)" in err, err


def test_a_merged_field_is_checked_and_named(tiny_llama):
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama.path, device="cpu", hf_overrides={"num_key_value_heads": 3})
    assert str(e.value) == (
        f"model config '{tiny_llama.path}/config.json': num_attention_heads=4 is not a "
        "multiple of num_key_value_heads=3 (config.json with --hf-overrides (hf_overrides) "
        '{"num_key_value_heads": 3} merged in)')
    with pytest.raises(ValueError, match="unsupported model architecture .'NoSuchModel'."):
        LLM(model=tiny_llama.path, device="cpu", hf_overrides={"architectures": ["NoSuchModel"]})


def test_sliding_window_override_changes_the_output_as_in_transformers(tiny_model_factory,
                                                                      assert_no_leaks):
    """The tiny Mistral's config.json says a window of 8; merged ``sliding_window: 4`` must
    give transformers' output with a window of 4 (which differs from window 8's)."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_model_factory("mistral_sliding_window")
    hf4 = AutoModelForCausalLM.from_pretrained(tiny.path, sliding_window=4).eval()
    narrow = dataclasses.replace(tiny, name="mistral_sliding_window_4", hf_model=hf4)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              hf_overrides={"sliding_window": 4})
    windows = {g.kv_cache_spec.sliding_window
               for g in llm.engine.core.kv_cache_config.kv_cache_groups}
    assert windows == {4}
    prompt = _prompts([20], tiny.vocab_size, seed=3)[0]
    out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert_matches_hf(narrow, out)
    assert hf_greedy(narrow, prompt).tokens != hf_greedy(tiny, prompt).tokens or \
        (hf_greedy(narrow, prompt).logprobs - hf_greedy(tiny, prompt).logprobs).abs().max() > 1e-3
    assert_no_leaks(llm)
