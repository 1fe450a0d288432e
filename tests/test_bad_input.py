"""Bad input is refused with a ValueError that names the problem, and never disturbs the
requests already running."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 32)
    kwargs.setdefault("block_size", 4)
    return LLM(model=path, dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    """An engine with max_model_len 24 on the tiny Llama."""
    return _llm(tiny_llama.path, max_model_len=24)


# ---- prompts -------------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm, assert_no_leaks):
    for n in (24, 40):  # a prompt must leave room for one generated token
        with pytest.raises(ValueError, match=r"max_model_len is 24"):
            llm.generate([[3] * n], GREEDY, use_tqdm=False)
    (out,) = llm.generate([[3] * 23], GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    assert_no_leaks(llm)


def test_prompt_past_what_the_kv_cache_holds_names_the_cache(llm, tiny_llama, assert_no_leaks):
    """max_model_len unset on a 4-block pool (block 0 is the null block: 3 x 4 = 12 tokens
    per request): the engine caps the model's 256 positions at 12, and a longer prompt is
    refused at once, saying the KV cache capped it (the error said only 'max_model_len is
    12', which the model's context contradicts) and what to raise; the engine keeps serving.
    (An explicit max_model_len the pool cannot hold is refused at start-up:
    tests/test_max_model_len_kv_cache.py.)"""
    small = _llm(tiny_llama.path, num_kv_blocks=4)
    assert small.engine.core.max_model_len == 12
    for n in (12, 20):
        with pytest.raises(ValueError, match=r"max_model_len is 12 \(capped from 256: the KV "
                                             r"cache holds 12 tokens per request; raise "
                                             r"--num-kv-blocks or --kv-cache-memory"):
            small.generate([[3] * n], GREEDY, use_tqdm=False)
    (out,) = small.generate([[3] * 11], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(small)
    # max_model_len within the cache: no note
    with pytest.raises(ValueError, match=r"max_model_len is 24: it must be shorter"):
        llm.generate([[3] * 30], GREEDY, use_tqdm=False)


def test_long_prompt_in_a_batch_queues_nothing(llm, assert_no_leaks):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[3, 4, 5], [3] * 30], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompts,bad,why", [
    ([[3, 4], []], 1, "the prompt is empty: it must contain at least one token"),
    ([[3, 4], [5], [3, 10**6]], 2, "prompt token id 1000000 is outside the vocabulary [0, {V})"),
    ([[3] * 30, [3, 4]], 0, ("the prompt has 30 tokens but max_model_len is 24: it must be "
                             "shorter to leave room for at least one generated token")),
], ids=["empty", "out_of_vocabulary", "too_long"])
def test_a_bad_prompt_of_several_is_named_by_its_index(llm, prompts, bad, why,
                                                       assert_no_leaks):
    """Of several prompts, the one refused is named by its index, as ``beam_search``,
    ``classify`` and the server name it (``kvflow generate --prompt a --prompt ""`` said only
    "the prompt is empty"); one prompt alone keeps the plain message."""
    why = why.replace("{V}", str(llm.engine.processor.vocab_size))
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert str(e.value) == f"prompt {bad}: {why}"
    with pytest.raises(ValueError) as e:
        llm.generate([prompts[bad]], GREEDY, use_tqdm=False)
    assert str(e.value) == why
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt", [[[]], ""], ids=["no_token_ids", "empty_text"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("prompt,match", [
    ([[3, 100000]], "outside the vocabulary"),
    ([[3, -1]], "outside the vocabulary"),
    ([[3, "x"]], "only integers, got 'x'"),
    ([[3, 1.5]], "only integers, got 1.5"),
    ([[True]], "only integers, got True"),
    ([3.5], "a string, a list of token ids or a dict prompt .*got float"),
    ({"prompt_token_ids": "abc"}, "'prompt_token_ids' must be a list"),
    ({"prompt": [3, 4]}, "'prompt' must be a string"),
])
def test_malformed_prompt(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_text_prompt_without_tokenizer(tiny_llama):
    llm = _llm(tiny_llama.path, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_rejected_later_params_queue_nothing(llm, assert_no_leaks):
    """Prompt 1's parameters fail a model-dependent check after prompt 0 was accepted: the
    whole call is refused and prompt 0 must not linger to run inside the next call."""
    bad = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={10**9: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[3, 4, 5], [6, 7]], [GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_max_tokens_none_fills_the_context(llm, assert_no_leaks):
    """``max_tokens=None`` (vLLM's "until the context is full"): 24 - 5 prompt tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (out,) = llm.generate([[3, 4, 5, 6, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 19 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_max_tokens_beyond_the_context_stops_at_it(llm, assert_no_leaks):
    """``max_tokens`` beyond what the context leaves is not refused offline: generation stops
    when the context is full, ``finish_reason`` "length" (vLLM's offline API does the same:
    its scheduler caps a request at max_model_len)."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    (out,) = llm.generate([[3, 4, 5, 6, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 24 - 5 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_min_tokens_beyond_the_context_with_max_tokens_none(llm, assert_no_leaks):
    """``max_tokens=None`` with ``min_tokens`` above what the context leaves is taken as an
    explicit ``max_tokens=min_tokens`` is (the test above): it stops when the context is full
    (was: a ValueError "min_tokens ... must be <= max_tokens (19)", a value never sent)."""
    for max_tokens in (None, 30):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=30)
        (out,) = llm.generate([[3, 4, 5, 6, 7]], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 24 - 5
        assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_model_dependent_limits_and_ignored_options_are_refused(llm, assert_no_leaks):
    """prompt_logprobs above the vocabulary (was a torch RuntimeError from top-k), a user
    name under the fcfs policy (only fair reads it), an empty chat template, chat template
    kwargs that are not a dict and a SamplingParams where PoolingParams belong: ValueErrors
    naming the field; the engine then still generates."""
    vocab = llm.engine.processor.vocab_size
    too_many = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=vocab + 1)
    with pytest.raises(ValueError, match=rf"prompt_logprobs={vocab + 1} exceeds the vocab"):
        llm.generate([[3, 4, 5]], too_many, use_tqdm=False)
    with pytest.raises(ValueError, match="user=.*fair"):
        llm.generate([[3, 4]], GREEDY, use_tqdm=False, user=["bob"])
    (out,) = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2,
                                                      prompt_logprobs=vocab), use_tqdm=False)
    assert len(out.prompt_logprobs[1]) == vocab  # every token's logprob for position 1
    assert_no_leaks(llm)


def test_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[3], [4], [5]], [GREEDY, GREEDY], use_tqdm=False)


def test_on_output_must_be_callable(llm, assert_no_leaks):
    """on_output=5 raised TypeError: 'int' object is not callable, from the first step (the
    requests queued, then aborted): now a ValueError naming it before anything is queued."""
    with pytest.raises(ValueError, match="on_output must be a callable"):
        llm.generate([[3]], GREEDY, use_tqdm=False, on_output=5)
    assert_no_leaks(llm)


# ---- sampling parameters -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": -2}, "logprobs"),  # -1 is vLLM's whole vocabulary
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    # wrong types: never a TypeError from deep in torch, never a silent truncation
    ({"logprobs": 2.5}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"n": 2.5}, "n"),
    ({"max_tokens": 8.5}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_tokens": 2.5}, "min_tokens"),
    ({"temperature": None}, "temperature"),
    ({"temperature": "0"}, "temperature"),
    ({"top_p": None}, "top_p"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: True}}, "logit_bias"),
    ({"logit_bias": {"7": 1.0, "07": 2.0}}, "logit_bias"),
    ({"logit_bias": [7, 1.0]}, "logit_bias"),  # was an AttributeError ('list' ... 'items')
    ({"logit_bias": 5}, "logit_bias"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_stop_strings_are_capped_at_128_of_256_characters():
    """20,000 stop strings of 1,000 characters were accepted (and slowed every other client:
    they are matched on the API process's output loop). The documented caps: 128 strings of
    256 characters pass; one more string, or one more character, is a ValueError saying the
    limit and what was sent (counts, not the strings)."""
    from kvflow.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS) == (128, 256)
    edge = [f"{i:03d}" + "x" * 253 for i in range(128)]
    assert SamplingParams(stop=edge).stop == edge
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=[*edge, "one more"])
    assert str(e.value) == ("SamplingParams.stop holds 129 strings: at most 128 stop strings "
                            "are accepted per request")
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["ok", "y" * 257])
    assert str(e.value) == ("SamplingParams.stop[1] holds 257 characters: at most 256 are "
                            "accepted per stop string")
    with pytest.raises(ValueError, match="holds 20000 strings"):
        SamplingParams(stop=["z" * 1000] * 20000)


@pytest.mark.parametrize("stop,message,code", [
    (["s"] * 129, "stop holds 129 strings: at most 128 stop strings are accepted per request",
     "array_above_max_length"),
    ("w" * 300, "stop[0] holds 300 characters: at most 256 are accepted per stop string",
     "string_above_max_length"),
])
def test_the_server_refuses_too_many_or_too_long_stops_naming_stop(stop, message, code):
    """The server's own conversion of a request (a stand-in engine, whose checks pass):
    a 400 with ``param`` ``stop``, before anything is queued, with the code the schema gives
    other too-long arrays and strings (it was ``invalid_value``)."""
    from types import SimpleNamespace

    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import CompletionRequest
    from kvflow.entrypoints.sampling_requests import sampling_params

    engine = SimpleNamespace(processor=SimpleNamespace(validate_params=lambda params: None))
    req = CompletionRequest.model_validate({"prompt": "a", "stop": stop})
    with pytest.raises(OpenAIError) as e:
        sampling_params(engine, req, max_tokens=4, logprobs=None)
    assert (e.value.status, e.value.param, e.value.code, str(e.value)) == \
        (400, "stop", code, message)


# ---- engine options and models -------------------------------------------------------------------
def test_unknown_engine_option(tiny_llama):
    with pytest.raises(ValueError, match="unknown engine option 'no_such_option'"):
        _llm(tiny_llama.path, no_such_option=1)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size"),
    ({"load_format": "pickle"}, "load_format"),
    ({"num_kv_blocks": 1}, "num_kv_blocks"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"device": "tpu"}, "device"),
    ({"attention_backend": "nope"}, "attention backend"),
    ({"policy": "random"}, "policy"),
    ({"max_num_seqs": 1.5}, "max_num_seqs=1.5 is invalid; it must be int"),
    ({"max_model_len": "64"}, "max_model_len='64' is invalid"),
    ({"max_model_len": 0}, "max_model_len=0 must be >= 1"),
    ({"max_model_len": -2}, "max_model_len=-2 must be >= 1"),  # -1 is vLLM's auto-fit
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching='no' is invalid"),
])
def test_bad_engine_values(tiny_llama, kwargs, match):
    kwargs = {"device": "cpu", "num_kv_blocks": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama.path, dtype="float32", **kwargs)


def test_bad_dtype(tiny_llama):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=tiny_llama.path, dtype="float64", device="cpu", num_kv_blocks=8)


def test_max_model_len_beyond_the_model(tiny_llama):
    """The tiny models have 256 positions: a longer context would index past the rotary
    table mid-generation, so it is refused up front."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _llm(tiny_llama.path, max_model_len=400, num_kv_blocks=200)


@pytest.mark.parametrize("model", ["no-such-model-xyz", "/nonexistent/folder/model"])
def test_unknown_model(model):
    with pytest.raises(ValueError, match="no-such-model-xyz|/nonexistent/folder/model"):
        LLM(model=model, device="cpu")


def test_model_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path), device="cpu")


# ---- a bad request does not disturb the running ones ---------------------------------------------
def _run_to_end(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_bad_add_request_leaves_others_running(tiny_llama, assert_no_leaks):
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [12, 13], "c": [14] * 9}
    config = {"model": tiny_llama.path, "dtype": "float32", "device": "cpu",
              "num_kv_blocks": 24, "block_size": 4, "max_model_len": 40,
              "max_num_batched_tokens": 8}
    reference = LLMEngine(EngineConfig.from_kwargs(**config))
    for rid, p in prompts.items():
        reference.add_request(p, GREEDY, request_id=rid)
    expected = {rid: out.outputs[0].token_ids for rid, out in _run_to_end(reference).items()}

    engine = LLMEngine(EngineConfig.from_kwargs(**config))
    for rid, p in prompts.items():
        engine.add_request(p, GREEDY, request_id=rid)
    engine.step()  # a, b and c are mid-prefill / decoding now
    engine.step()
    bad = [
        ([], GREEDY, "empty"),
        ([3] * 40, GREEDY, "max_model_len"),
        ([3, 10**6], GREEDY, "vocabulary"),
        ([3, 4], GREEDY, "already in use"),  # request id "a" is in flight
    ]
    for prompt, params, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, params, request_id="a" if match == "already in use"
                               else "bad")
    finished = _run_to_end(engine)
    assert {rid: out.outputs[0].token_ids for rid, out in finished.items()} == expected
    assert finished["a"].prompt_token_ids == prompts["a"]

    shim = type("Shim", (), {"engine": engine})()  # assert_no_leaks reads llm.engine
    assert_no_leaks(shim)


def test_abort_in_flight(tiny_llama, assert_no_leaks):
    """Aborting a request mid-generation frees its blocks; the others finish unchanged."""
    config = {"model": tiny_llama.path, "dtype": "float32", "device": "cpu",
              "num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 8}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = LLMEngine(EngineConfig.from_kwargs(**config))
    reference.add_request([12, 13, 14], params, request_id="keep")
    expected = _run_to_end(reference)["keep"].outputs[0].token_ids
    engine = LLMEngine(EngineConfig.from_kwargs(**config))
    engine.add_request([5] * 11, params, request_id="drop")
    engine.add_request([12, 13, 14], params, request_id="keep")
    for _ in range(3):
        engine.step()
    engine.abort_request("drop")
    engine.abort_request("never-added")  # unknown ids are ignored
    finished = _run_to_end(engine)
    assert set(finished) == {"keep"} and finished["keep"].outputs[0].token_ids == expected
    shim = type("Shim", (), {"engine": engine})()
    assert_no_leaks(shim)
