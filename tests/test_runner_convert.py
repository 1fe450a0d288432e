"""vLLM's ``--runner`` / ``--convert`` (its replacement of ``--task``) on kvflow's tasks: a
tiny random causal Llama under ``runner="pooling"`` is converted to an embedding model as vLLM
converts it (its last token's final hidden state, L2-normalized, checked against the HF
model's), ``runner="generate"`` generates, and the combinations kvflow cannot serve are
refused naming both flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.config.model import ModelConfig
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.serving_pooling import OpenAIServingPooling
from kvflow.models.model_task import resolve_task

TEXT = "the quick brown fox"


def _hf_embedding(tiny_llama, llm: LLM) -> torch.Tensor:
    ids = llm.get_tokenizer().encode(TEXT, return_tensors="pt")
    with torch.no_grad():
        hidden = tiny_llama.hf_model.model(input_ids=ids).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)


@pytest.mark.parametrize("kwargs", [{"runner": "pooling"}, {"convert": "embed"},
                                    {"runner": "pooling", "convert": "embed"}])
def test_pooling_runner_converts_a_causal_lm_to_embed(tiny_llama, kwargs):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              **kwargs)
    got = torch.tensor(llm.embed(TEXT, use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(got, _hf_embedding(tiny_llama, llm), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="task='embed'"):  # it no longer generates
        llm.generate("hi", SamplingParams(max_tokens=2))


def test_generate_runner_generates(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              runner="generate", convert="none")
    out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_pooling_runner_without_conversion_needs_a_pooling_architecture(tiny_llama):
    with pytest.raises(ValueError, match="--runner pooling --convert none needs"):
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
            runner="pooling", convert="none")


@pytest.mark.parametrize("kwargs,needle", [
    ({"runner": "draft"}, "--runner draft is not available"),
    ({"runner": "generate", "convert": "embed"}, "--runner generate with --convert embed"),
    ({"runner": "generate", "convert": "classify"},
     "--runner generate with --convert classify"),
    ({"task": "embed", "runner": "pooling"}, "--task embed with --runner pooling"),
])
def test_refused_combinations(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**kwargs)


def test_requested_task_mapping():
    """Each pair's task (hand-written from vLLM's ``_get_runner_type`` / ``_get_convert_type``)
    and what it resolves to for a generating and for a sequence-classifying architecture."""
    cases = {("auto", "auto"): "auto", ("auto", "none"): "auto", ("generate", "auto"): "generate",
             ("generate", "none"): "generate", ("pooling", "auto"): "pooling",
             ("pooling", "none"): "pooling_native", ("auto", "embed"): "embed",
             ("pooling", "classify"): "classify"}
    for (runner, convert), task in cases.items():
        assert ModelConfig(runner=runner, convert=convert).requested_task == task
    assert resolve_task("pooling", False, None) == "embed"
    assert resolve_task("pooling", False, None, is_cross_encoder=True) == "score"
    assert resolve_task("pooling_native", False, None, is_cross_encoder=True) == "score"
    assert resolve_task("pooling", True, None) == "embed"
    assert resolve_task("pooling", False, None, is_token_classifier=True) == "token_classify"


def test_cli_and_config_file(tmp_path):
    from kvflow.entrypoints.config_file import expand_config_file

    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--runner", "pooling", "--convert", "embed"])
    mc = EngineConfig.from_cli_args(args).model_config
    assert (mc.runner, mc.convert, mc.requested_task) == ("pooling", "embed", "embed")
    path = tmp_path / "serve.yaml"
    path.write_text("runner: pooling\nconvert: none\n")
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
    assert EngineConfig.from_cli_args(args).model_config.requested_task == "pooling_native"


@pytest.mark.parametrize("kwargs,asked", [
    ({"convert": "classify"}, "task='classify' (--convert classify)"),
    ({"runner": "pooling", "convert": "classify"},
     "task='classify' (--runner pooling --convert classify)"),
    ({"task": "classify"}, "task='classify'"),  # --task: named as before
])
def test_refusal_names_the_flags_given(tiny_llama, kwargs, asked):
    """A generating model cannot be converted to a classifier here: the refusal names
    --runner / --convert when those chose the task (it said task='classify' alone)."""
    with pytest.raises(ValueError) as err:
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64, **kwargs)
    assert str(err.value).startswith(f"{asked} needs a sequence classifier (")


def _checks(runs: str, **model_kwargs) -> OpenAIServingPooling:
    """The server's request checks over an engine that runs task ``runs`` (no pooler
    config: that task alone) under a ModelConfig of ``model_kwargs`` (only what the task
    refusals read)."""
    checks = OpenAIServingPooling.__new__(OpenAIServingPooling)
    checks.engine = SimpleNamespace(task=runs, processor=SimpleNamespace(pooler=None),
                                    config=EngineConfig.from_kwargs(**model_kwargs))
    return checks


@pytest.mark.parametrize("runs, asked, serve", [
    ("generate", "embed", "--runner pooling --convert embed (or --task embed)"),
    ("generate", "classify", "--runner pooling --convert classify (or --task classify)"),
    ("embed", "generate", "--runner generate (or --task generate)"),
])
def test_wrong_task_names_vllms_runner_and_convert(runs, asked, serve):
    """/v1/embeddings on a generating server suggested nothing that serves embeddings (only
    the routes this server has); now the flags that start such a server, vLLM 0.32's
    --runner / --convert first (hand-written oracle)."""
    use = {"generate": "/v1/completions or /v1/chat/completions",
           "embed": "/v1/embeddings, /v1/score or /v1/rerank"}[runs]
    with pytest.raises(OpenAIError) as err:
        _checks(runs).check_task(asked)
    assert str(err.value) == (f"this server's model runs task={runs!r} (--task); this "
                              f"endpoint needs task={asked!r}: use {use}, or start a server "
                              f"with {serve}")


def test_offline_embed_on_a_generation_model_names_runner_and_convert():
    """LLM.embed on a generation model named --task embed only."""
    from kvflow.inputs.pooling import PoolingInputs

    processor = SimpleNamespace(pooler=None)
    with pytest.raises(ValueError) as err:
        PoolingInputs.require_task(processor, "embed")
    assert str(err.value) == (
        "this model generates text: embeddings need a model served with task='embed' "
        "(--task embed), or vLLM 0.32's runner='pooling' convert='embed' (--runner pooling "
        "--convert embed), which also turn a text generation model into an embedding model")


def test_server_refusals_name_the_flags_given():
    """/v1/completions on a --runner pooling --convert embed server said "runs task='embed'
    (--task)", a flag the user never typed."""
    flags = {"runner": "pooling", "convert": "embed"}
    with pytest.raises(OpenAIError) as err:
        _checks("embed", **flags).check_task("generate")
    assert str(err.value).startswith("this server's model runs task='embed' (--runner pooling "
                                     "--convert embed); this endpoint needs task='generate'")
    with pytest.raises(OpenAIError) as err:
        _checks("embed", task="embed").check_task("generate")
    assert str(err.value).startswith("this server's model runs task='embed' (--task); ")
    with pytest.raises(OpenAIError) as err:  # /pooling on a generating server
        _checks("generate", runner="generate")._task(None)
    assert str(err.value).startswith("this server's model runs task='generate' "
                                     "(--runner generate); /pooling needs a pooling model")
    assert ModelConfig(convert="embed").task_flags == "--convert embed"
    assert ModelConfig().task_flags == "--task"
