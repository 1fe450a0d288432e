"""Names a vLLM user types: a misspelled ``LLM(...)`` keyword is answered with the closest
valid one in a short message (it was a ValueError listing ~150 names in 1,800 characters), and
so is a misspelled field of the request parameter classes (a bare TypeError naming only the
unknown keyword; TypeError stays, as vLLM's msgspec Structs raise it)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvflow import LLM, BeamSearchParams, PoolingParams, SamplingParams
from kvflow.config import EngineConfig
from kvflow.config import engine as engine_config
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.config_file import leaf_parsers
from kvflow.structured.params import StructuredOutputsParams

HELP_POINTER = ("; `kvflow serve --help` lists them as the flags of its groups ModelConfig to "
                "KVTransferConfig (--max-model-len is max_model_len)")


@pytest.mark.parametrize("key,guess", [
    ("modle", "model"),
    ("gpu_memory_utilisation", "gpu_memory_utilization"),
    ("tensor_parallel", "tensor_parallel_size"),
    ("scheduling_polcy", "scheduling_policy"),  # vLLM's alias of policy
    ("spec_token", "spec_tokens"),  # vLLM's speculative shorthand
    ("speculative_confg", "speculative_config"),  # a JSON section
])
def test_unknown_engine_option_names_the_close_one(key, guess):
    """EngineConfig.from_kwargs (what LLM and an AsyncLLM's config are built by)."""
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs(model="m", **{key: 1})
    assert str(e.value) == f"unknown engine option {key!r} (did you mean {guess!r}?)" \
        + HELP_POINTER


def test_llm_unknown_keyword_names_the_close_one():
    """The newcomer's line: refused before any model is looked for."""
    with pytest.raises(ValueError) as e:
        LLM(model="no/such-model", modle="x")
    assert str(e.value) == "unknown engine option 'modle' (did you mean 'model'?)" + HELP_POINTER


def test_unknown_engine_option_without_a_close_one():
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs(model="m", no_such_option=1)
    assert str(e.value) == "unknown engine option 'no_such_option'" + HELP_POINTER


def test_help_pointer_lists_every_engine_keyword():
    """What the message says is true: the flags of ``kvflow serve``'s groups ModelConfig to
    KVTransferConfig, written with _ for -, are the keywords from_kwargs takes (those kvflow
    sets itself, ``cli=False``, have no flag)."""
    serve, = (p for p in leaf_parsers(build_parser("serve")) if p.prog.endswith(" serve"))
    titles = [g.title for g in serve._action_groups]
    groups = serve._action_groups[titles.index("ModelConfig"):
                                  titles.index("KVTransferConfig") + 1]
    listed = {o[2:].replace("-", "_") for g in groups for a in g._group_actions
              for o in a.option_strings
              if o.startswith("--") and not (o.startswith("--no-") and "--" + o[5:] in a.option_strings)}
    sections = engine_config._SECTIONS.values()
    accepted = {f.name for c in sections for f in fields(c)} | \
        {a.lstrip("-").replace("-", "_") for c in sections for f in fields(c)
         for a in f.metadata.get("aliases", ())} | \
        set(engine_config._JSON_SECTIONS) | set(engine_config._SPEC_KEYWORDS)
    internal = {f.name for c in sections for f in fields(c) if f.metadata.get("cli") is False}
    assert internal and listed == accepted - internal


@pytest.mark.parametrize("cls,key,guess", [
    (SamplingParams, "max_token", "max_tokens"),
    (SamplingParams, "temprature", "temperature"),
    (SamplingParams, "stop_token_id", "stop_token_ids"),
    (PoolingParams, "normalise", "normalize"),
    (BeamSearchParams, "beam_widht", "beam_width"),
    (StructuredOutputsParams, "jsn", "json"),
])
def test_params_unknown_field_names_the_close_one(cls, key, guess):
    with pytest.raises(TypeError) as e:
        cls(**{key: 5})
    assert str(e.value) == (f"{cls.__name__}.__init__() got an unexpected keyword argument "
                            f"{key!r} (did you mean {guess!r}?)")


def test_params_unknown_field_without_a_close_one():
    """Python's own message, which names the keyword."""
    with pytest.raises(TypeError) as e:
        SamplingParams(max_tokens=5, xyzzy=1)
    assert str(e.value) == "SamplingParams.__init__() got an unexpected keyword argument 'xyzzy'"


def test_params_known_fields_unchanged():
    params = SamplingParams(max_tokens=5, top_k=-1)
    assert (params.max_tokens, params.top_k, params.fields_set) == (5, 0, {"max_tokens", "top_k"})
    beam = BeamSearchParams(4, max_tokens=3)
    assert (beam.beam_width, beam.max_tokens) == (4, 3)
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=3)


# ---- vLLM 0.32's import paths --------------------------------------------------------------------
# vllm.__all__ (vLLM 0.32); the names kvflow has no counterpart of are VLLM_ONLY
VLLM_ALL = ("__version__", "__version_tuple__", "LLM", "ModelRegistry", "PromptType", "TextPrompt",
            "TokensPrompt", "SamplingParams", "RequestOutput", "CompletionOutput", "PoolingOutput",
            "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
            "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
            "ScoringRequestOutput", "LLMEngine", "EngineArgs", "AsyncLLMEngine",
            "AsyncEngineArgs", "initialize_ray_cluster", "PoolingParams")
VLLM_ONLY = {"__version_tuple__", "ModelRegistry", "EngineArgs", "AsyncLLMEngine",
             "AsyncEngineArgs", "initialize_ray_cluster"}


def test_vllm_top_level_names():
    """Every name of vllm.__all__ kvflow implements is in kvflow.__all__ and resolves."""
    import kvflow

    assert set(VLLM_ALL) - set(kvflow.__all__) == VLLM_ONLY
    for name in kvflow.__all__:
        assert getattr(kvflow, name) is not None, name


@pytest.mark.parametrize("vllm_path,own_path", [
    ("kvflow.sampling_params:BeamSearchParams", "kvflow:BeamSearchParams"),
    ("kvflow.sampling_params:BeamSearchParams", "kvflow.beam_search:BeamSearchParams"),
    ("kvflow.sampling_params:StructuredOutputsParams", "kvflow.structured.params:StructuredOutputsParams"),
    ("kvflow.sampling_params:RequestOutputKind", "kvflow:RequestOutputKind"),
    ("kvflow.inputs:TextPrompt", "kvflow:TextPrompt"),
    ("kvflow.inputs:TokensPrompt", "kvflow:TokensPrompt"),
    ("kvflow.inputs:PromptType", "kvflow:PromptType"),
    ("kvflow.inputs:PromptType", "kvflow.inputs.prompts:PromptType"),
    ("kvflow.outputs:EmbeddingOutput", "kvflow:EmbeddingOutput"),
    ("kvflow.outputs:EmbeddingRequestOutput", "kvflow:EmbeddingRequestOutput"),
    ("kvflow.outputs:PoolingOutput", "kvflow:PoolingOutput"),
    ("kvflow.outputs:ScoringOutput", "kvflow:ScoringOutput"),
    ("kvflow.outputs:ClassificationOutput", "kvflow:ClassificationOutput"),
    ("kvflow.pooling_params:PoolingParams", "kvflow:PoolingParams"),
    ("kvflow.lora.request:LoRARequest", "kvflow:LoRARequest"),
])
def test_vllm_import_path_is_kvflows_own(vllm_path, own_path):
    import importlib

    def resolve(path: str) -> object:
        module, name = path.split(":")
        return getattr(importlib.import_module(module), name)

    assert resolve(vllm_path) is resolve(own_path)


def test_prompt_typeddicts_are_the_dicts_kvflow_parses():
    """vLLM's TypedDicts build plain dicts; every key they declare is one kvflow's parser
    reads (``unpack_prompt`` for text and token ids, ``InputProcessor`` for embeddings)."""
    from kvflow.inputs import EmbedsPrompt, TextPrompt, TokensPrompt
    from kvflow.inputs.prompts import tokenize_prompt, unpack_prompt

    options = {"cache_salt", "multi_modal_data", "mm_processor_kwargs"}
    assert (TextPrompt.__required_keys__, TextPrompt.__optional_keys__) == ({"prompt"}, options)
    assert (TokensPrompt.__required_keys__, TokensPrompt.__optional_keys__) == \
        ({"prompt_token_ids"}, options | {"prompt"})
    assert (EmbedsPrompt.__required_keys__, EmbedsPrompt.__optional_keys__) == \
        ({"prompt_embeds"}, {"cache_salt", "prompt"})
    tokens = TokensPrompt(prompt_token_ids=[5, 6], cache_salt="s", multi_modal_data={},
                          mm_processor_kwargs={})
    assert type(tokens) is dict and tokenize_prompt(None, tokens) == (None, [5, 6])
    text = TextPrompt(prompt="hi", cache_salt="s", multi_modal_data={}, mm_processor_kwargs={})
    assert unpack_prompt(text) == ("hi", [], [])


def test_a_tokens_prompt_may_carry_its_text(tiny_llama):
    """vLLM's TokensPrompt ``prompt`` (was refused: "exactly one of 'prompt' and
    'prompt_token_ids'"): the ids are what the model reads (the same greedy tokens as the
    ids alone, not the text's), the text is the output's ``prompt``; AsyncLLM.generate
    reads it the same way (one processing path)."""
    from kvflow import LLM, SamplingParams
    from kvflow.inputs import TokensPrompt

    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [1, 5, 9, 13, 17]
    text = "text that is not those ids"
    plain, given, from_text = llm.generate(
        [ids, TokensPrompt(prompt_token_ids=ids, prompt=text), text], params, use_tqdm=False)
    assert (given.prompt, given.prompt_token_ids) == (text, ids)
    assert plain.prompt is None
    assert given.outputs[0].token_ids == plain.outputs[0].token_ids
    assert from_text.prompt_token_ids != ids
    with pytest.raises(ValueError, match="'prompt' must be a string, got list"):
        llm.generate({"prompt_token_ids": ids, "prompt": [1]}, params, use_tqdm=False)
