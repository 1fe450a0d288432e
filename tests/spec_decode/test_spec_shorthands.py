"""vLLM's ``--spec-method`` / ``--spec-model`` / ``--spec-tokens`` (shorthands of three
``--speculative-config`` keys, vLLM's ``EngineArgs.create_speculative_config``): CLI, config
file and ``LLM`` keywords set the same SpeculativeConfig as the JSON; an engine started by the
shorthands drafts (n-gram) and its greedy output equals plain greedy output; a key given both
ways is refused naming the flag."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.config.speculative import SpeculativeConfig, merge_spec_shorthands
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.config_file import expand_config_file
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs


def _spec(*argv: str) -> SpeculativeConfig | None:
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "m", *argv]))
    return EngineConfig.from_cli_args(args).speculative_config


def test_flags_set_the_keys():
    spec = _spec("--spec-method", "ngram", "--spec-tokens", "3")
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    both = _spec("--spec-tokens", "2", "--speculative-config",
                 '{"method": "ngram", "prompt_lookup_max": 2}')
    assert (both.method, both.num_speculative_tokens, both.prompt_lookup_max) == \
        ("ngram", 2, 2)
    drafted = _spec("--spec-model", "SmolLM2-135M-Instruct", "--spec-tokens", "5")
    assert (drafted.method, drafted.model, drafted.num_speculative_tokens) == \
        ("draft_model", "SmolLM2-135M-Instruct", 5)  # a model alone: draft_model, as vLLM
    assert _spec() is None and _spec("--speculative-config", "null") is None


def test_config_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("spec-method: ngram\nspec_tokens: 6\n")
    spec = _spec("--config", str(path))
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 6)


@pytest.mark.parametrize("argv,needle", [
    (["--spec-tokens", "3", "--speculative-config", '{"num_speculative_tokens": 2}'],
     "--spec-tokens and --speculative-config's 'num_speculative_tokens' are mutually"),
    (["--spec-method", "ngram", "--speculative-config", '{"method": "ngram"}'],
     "--spec-method and --speculative-config's 'method'"),
])
def test_both_ways_refused(capsys, argv, needle):
    assert main(["serve", "m", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--spec-tokens", "3"],
                                  ["--speculative-config", '{"num_speculative_tokens": 3}'],
                                  ["--spec-tokens", "3", "--speculative-config",
                                   '{"adaptive": false}']])
def test_tokens_without_method_or_model_are_refused(capsys, argv):
    """vLLM refuses num_speculative_tokens without a method or model ("num_speculative_tokens
    was provided but without speculative model."); kvflow ran n-gram lookup instead."""
    assert main(["serve", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert "speculative_config names no proposer: neither 'method' nor 'model'" in err
    assert "--spec-method M" in err and "--spec-model NAME" in err
    with pytest.raises(ValueError, match="names no proposer"):
        LLM(model="m", spec_tokens=3)


def test_refused_beside_a_config_object():
    with pytest.raises(ValueError, match="--spec-tokens beside a SpeculativeConfig"):
        merge_spec_shorthands(SpeculativeConfig(method="ngram"), {"spec_tokens": 3})


def test_llm_keywords_draft_and_keep_greedy_output(tiny_llama, assert_no_leaks):
    kw = {"model": tiny_llama.path, "dtype": "float32", "block_size": 4, "num_kv_blocks": 96}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(**kw).generate(PROMPTS, params, use_tqdm=False)
    spec_llm = LLM(**kw, spec_method="ngram", spec_tokens=4,
                   speculative_config={"prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                       "adaptive": False})
    got = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(base, got)
    drafted, accepted = _drafted(got)
    assert 0 < accepted <= drafted
    assert max(o.metrics.num_draft_tokens for o in got) > 0
    assert_no_leaks(spec_llm)
