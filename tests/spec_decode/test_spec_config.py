"""``--speculative-config`` / ``LLM(speculative_config=...)``: parsing, validation (one
ValueError or exit status 2 naming what is wrong), the YAML config file form."""

from __future__ import annotations

import argparse
import json

import pytest

from kvflow.config import EngineConfig, SpeculativeConfig
from kvflow.entrypoints.cli import main


def _parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


def test_flag_dict_and_object_forms_agree():
    flag = _parse(["--speculative-config",
                   '{"method": "draft_model", "model": "m", "num_speculative_tokens": 3}'])
    kwargs = EngineConfig.from_kwargs(speculative_config={
        "method": "draft_model", "model": "m", "num_speculative_tokens": 3})
    assert flag.speculative_config == kwargs.speculative_config == SpeculativeConfig(
        method="draft_model", model="m", num_speculative_tokens=3)
    assert _parse([]).speculative_config is None
    ngram = SpeculativeConfig.from_value('{"method": "ngram", "prompt_lookup_max": 5}')
    assert (ngram.prompt_lookup_max, ngram.prompt_lookup_min, ngram.adaptive) == (5, 2, True)


@pytest.mark.parametrize("value, needle", [
    ('{"method": "eagle"}', "method='eagle' needs 'model'"),
    ('{"method": "eagle", "model": "h", "quantization": "int8"}', "quantization='int8'"),
    # named "an n-gram proposer" for a head before; an EAGLE-3 head's draft vocabulary is
    # the checkpoint's (d2t), an EAGLE head's the target's
    ('{"method": "eagle", "model": "h", "draft_vocab_size": 1000}',
     "draft_vocab_size=1000 applies to method='draft_model' only (the eagle head"),
    ('{"method": "eagle3"}', "method='eagle3' needs 'model'"),
    ('{"method": "eagle3", "model": "h", "quantization": "int4"}', "quantization='int4'"),
    ('{"method": "eagle3", "model": "h", "draft_vocab_size": 1000}',
     "draft_vocab_size=1000 applies to method='draft_model' only (the eagle3 head"),
    ('{"method": "medusa", "model": "h"}', "method='medusa' is invalid"),
    ('{"method": "ngram", "k": 3}', "unknown key(s) ['k']"),
    ('{"method": "draft_model"}', "needs 'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens='4'"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "1 <= min <= max"),
    ('{"method": "ngram"', "not valid JSON"),
    ("", "is empty, which is not valid JSON"),  # was taken as "no speculation"
    ("  ", "is empty, which is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "ngram", "quantization": "fp4"}', "quantization='fp4'"),
    ('{"method": "draft_model", "model": "m", "draft_vocab_size": -1}', "draft_vocab_size=-1"),
    ('{"method": "draft_model", "model": "m", "draft_vocab_size": "big"}',
     "draft_vocab_size='big'"),
    ('{"method": "draft_model", "model": "m", "draft_vocab_size": 1.5}', "draft_vocab_size=1.5"),
    ('{"method": "draft_model", "model": "m", "quantization": "int3"}', "quantization='int3'"),
    ('{"method": "draft_model", "model": "m", "draft_vocab_size": true}',
     "draft_vocab_size=True"),
    ('{"method": "ngram", "draft_vocab_size": 64}', "method='draft_model' only"),
    ('{"method": "ngram", "model": "m"}', "model='m' applies to method='draft_model' only"),
    # the other method's keys were accepted and ignored
    ('{"method": "ngram", "draft_cpu_threads": 2}', "draft_cpu_threads=2 applies to method="),
    ('{"method": "ngram", "quantization": "int4"}',
     "quantization='int4' applies to method='draft_model' only"),
    ('{"model": "m", "prompt_lookup_min": 3}', "apply to method='ngram' only"),
    ('{"method": "draft_model", "model": "m", "prompt_lookup_max": 8}',
     "prompt_lookup_max=8 / prompt_lookup_min=2 apply to method='ngram' only"),
    ('{"model": "  "}', "model='  ' is empty"),  # was n-gram lookup, the model ignored
])
def test_bad_values_name_the_problem(value, needle):
    with pytest.raises(ValueError, match=None) as err:
        SpeculativeConfig.from_value(value)
    assert needle in str(err.value)


def test_a_missing_method_is_inferred_as_vllm_does():
    """No ``method``: ``draft_model`` when a ``model`` is named, ``ngram`` for vLLM's model
    "ngram" / "[ngram]"; with neither, refused as vLLM's ``SpeculativeConfig`` refuses it
    (``method`` None becomes draft_model there, which then has no model): no n-gram lookup
    nobody asked for."""
    draft = SpeculativeConfig.from_value('{"model": "m", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "m", 3)
    for spelling in ("ngram", "[ngram]"):
        ngram = SpeculativeConfig.from_value({"model": spelling, "num_speculative_tokens": 2})
        assert (ngram.method, ngram.model, ngram.num_speculative_tokens) == ("ngram", None, 2)
    for value in ('{"num_speculative_tokens": 3}', "{}", {"prompt_lookup_max": 3},
                  {"method": None, "model": None, "num_speculative_tokens": 3}):
        with pytest.raises(ValueError) as err:
            SpeculativeConfig.from_value(value)
        assert str(err.value).startswith(
            "speculative_config names no proposer: neither 'method' nor 'model' is given")
        assert "give --spec-method M" in str(err.value)
        assert "or --spec-model NAME" in str(err.value)
    with pytest.raises(ValueError, match="names no proposer"):
        SpeculativeConfig(num_speculative_tokens=3)  # the Python object the same way


def test_draft_defaults_are_int8_and_a_32k_head_on_a_cpu():
    """``auto`` (the default): INT8 weights and a 32768-id head on a CPU, the draft as loaded
    elsewhere, for a checkpoint quantized already and under --deterministic; each turned off
    on its own by ``"quantization": "none"`` or null and ``"draft_vocab_size": 0`` or
    null."""
    def options(device="cpu", prequantized=False, deterministic=False, **kw):
        config = SpeculativeConfig.from_value({"method": "draft_model", "model": "m", **kw})
        return config.draft_options(device, prequantized, deterministic)

    assert options() == ("int8", 32768)
    assert options("cuda") == (None, None)
    assert options(prequantized=True) == (None, 32768)
    # --deterministic: the draft as loaded (quantized GEMMs have no batch-invariant kernel)
    assert options(deterministic=True) == (None, 32768)
    assert options(quantization="none") == options(quantization=None) == (None, 32768)
    assert options(draft_vocab_size=0) == options(draft_vocab_size=None) == ("int8", None)
    assert options(quantization="int4", draft_vocab_size=4096) == ("int4", 4096)
    assert options("cuda", quantization="int8", draft_vocab_size=4096) == ("int8", 4096)
    assert SpeculativeConfig.from_value('{"method": "draft_model", "model": "m", '
                                        '"quantization": null}').quantization is None


def test_pipeline_parallel_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2,
                                 speculative_config={"method": "ngram"})


def test_async_scheduling_is_refused():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_kwargs(async_scheduling=True, speculative_config={"method": "ngram"})
    # unset: the engine core leaves it off when speculating
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram"})
    assert config.scheduler_config.async_scheduling is None


def test_draft_model_takes_tensor_parallel_and_swap_preemption():
    draft = {"method": "draft_model", "model": "some-draft"}
    config = EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_config=draft)
    assert config.parallel_config.world_size == 2  # every rank holds the whole draft
    # the host pool holds the draft's K/V too (tests/core/test_swap_more.py)
    config = EngineConfig.from_kwargs(preemption_mode="swap", speculative_config=draft)
    assert config.scheduler_config.preemption_mode == "swap"


@pytest.mark.parametrize("kwargs, needle", [
    ({"enable_lora": True}, "enable_lora"),
    ({"preemption_mode": "swap"}, "preemption_mode swap"),
])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "deepseek_mtp"])
def test_heads_refuse_what_they_cannot_run(method, kwargs, needle):
    head = {"method": method, "model": "some-head"}
    with pytest.raises(ValueError, match=f"method='{method}' with {needle}"):
        EngineConfig.from_kwargs(speculative_config=head, **kwargs)
    config = EngineConfig.from_kwargs(speculative_config=head)  # alone: accepted, as loaded
    assert config.speculative_config.draft_options("cpu") == (None, None)


def test_deepseek_mtp_model_defaults_to_the_target():
    config = EngineConfig.from_kwargs(model="some-v3", speculative_config={
        "method": "deepseek_mtp", "num_speculative_tokens": 1})
    assert config.speculative_config.model == "some-v3"
    with pytest.raises(ValueError, match="quantization='int4'"):
        SpeculativeConfig(method="deepseek_mtp", quantization="int4")


def test_cli_bad_value_exits_2(capsys):
    assert main(["generate", "--prompt", "hi", "--speculative-config", '{"method": 1}']) == 2
    assert "speculative_config" in capsys.readouterr().err


def test_yaml_config_file_takes_a_mapping(tmp_path):
    from kvflow.entrypoints.config_file import expand_config_file

    path = tmp_path / "engine.yaml"
    path.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 6\n")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    gen = sub.add_parser("generate")
    gen.add_argument("--config")
    EngineConfig.add_cli_args(gen)
    argv = expand_config_file(parser, ["generate", "--config", str(path)])
    args = parser.parse_args(argv)
    assert EngineConfig.from_cli_args(args).speculative_config.num_speculative_tokens == 6


def test_serve_with_a_missing_draft_model_exits_2_without_a_traceback(tiny_llama, tmp_path,
                                                                      capfd):
    """The engine core's start-up ValueError reaches ``kvflow serve`` as a ValueError: exit
    status 2 and a message naming the key, no traceback from either process."""
    missing = str(tmp_path / "no-such-draft")
    spec = json.dumps({"method": "draft_model", "model": missing})
    rc = main(["serve", tiny_llama.path, "--num-kv-blocks", "64", "--port", "0",
               "--speculative-config", spec])
    err = capfd.readouterr().err
    assert rc == 2, err
    assert f"kvflow: error: speculative_config model {missing!r}:" in err
    assert "Traceback" not in err
