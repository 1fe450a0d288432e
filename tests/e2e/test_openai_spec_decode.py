"""``kvflow serve --speculative-config`` end to end on the tiny Llama: greedy completions
(whole and streamed) equal plain offline greedy decoding, and /metrics reports the drafts."""

from __future__ import annotations

import json

import pytest

from kvflow import LLM, SamplingParams
from tests.e2e.conftest import ready_side_by_side

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "adaptive": False}
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
               "--block-size", "4", "--max-model-len", "96"]
PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox",
           "a b a b a b a b a"]


def _server_args(tiny_chat_model: str) -> list[list[str]]:
    """The arguments of the n-gram server and of the draft-model server."""
    draft_spec = {"method": "draft_model", "model": tiny_chat_model,
                  "num_speculative_tokens": 3, "adaptive": False,
                  "quantization": "none"}  # as loaded: a self-draft stays exact
    return [[*ENGINE_ARGS, "--served-model-name", "tiny", "--speculative-config",
             json.dumps(spec)] for spec in (SPEC, draft_spec)]


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    model = fixture("tiny_chat_model")
    return [(model, args, None) for args in _server_args(model)]


@pytest.fixture(scope="module")
def servers(start_server, request):
    """(n-gram server, draft-model server), started side by side."""
    started = [start_server.declared(request, i, wait=False) for i in range(2)]
    with ready_side_by_side(*started):
        yield started


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def test_greedy_completions_and_metrics(server, tiny_chat_model):
    plain = LLM(model=tiny_chat_model, dtype="float32", num_kv_blocks=128, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    client = server.client()
    for prompt, text in zip(PROMPTS, expected):
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == text
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    m = server.metrics()
    drafted = server.value(m, "kvflow:spec_decode_num_draft_tokens_total")
    accepted = server.value(m, "kvflow:spec_decode_num_accepted_tokens_total")
    drafts = server.value(m, "kvflow:spec_decode_num_drafts_total")
    assert 0 < accepted < drafted and 0 < drafts <= drafted
    per_pos = sum(server.value(m, "kvflow:spec_decode_num_accepted_tokens_per_pos_total",
                               position=str(i)) for i in range(4))
    assert per_pos == accepted
    assert abs(server.value(m, "kvflow:spec_decode_draft_acceptance_rate")
               - accepted / drafted) < 1e-9
    assert abs(server.value(m, "kvflow:spec_decode_mean_acceptance_length")
               - (1 + accepted / drafts)) < 1e-9
    assert server.value(m, "kvflow:kv_cache_usage_perc") == 0


def test_streamed_structured_output_with_usage(server, tiny_chat_model):
    """A regex-constrained greedy completion streamed from the n-gram server, with
    logprobs and continuous usage: the joined text is plain constrained decoding's and
    matches the regex, every chunk's usage counts the tokens sent so far (a verification
    step sends several), and drafts were accepted."""
    import re

    from kvflow.structured import StructuredOutputsParams

    regex = "(ab ){6,9}(the|a) fox"
    plain = LLM(model=tiny_chat_model, dtype="float32", num_kv_blocks=128, block_size=4)
    expected = plain.generate(PROMPTS[1], SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
        use_tqdm=False)[0].outputs[0]
    before = server.value(server.metrics(), "kvflow:spec_decode_num_accepted_tokens_total")
    stream = server.client().completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
        logprobs=1, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"structured_outputs": {"regex": regex}})
    text, sent, finish = "", 0, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            sent += len(choice.logprobs.tokens) if choice.logprobs else 0
            finish = choice.finish_reason or finish
        assert chunk.usage.completion_tokens == sent
    assert (text, finish) == (expected.text, "stop") and re.fullmatch(regex, text)
    assert sent == len(expected.token_ids)
    after = server.value(server.metrics(), "kvflow:spec_decode_num_accepted_tokens_total")
    assert after > before


@pytest.fixture(scope="module")
def draft_server(servers):
    return servers[1]


def test_draft_model_over_http(draft_server, tiny_chat_model):
    """The model as its own draft: greedy completions equal plain offline greedy decoding,
    nearly every draft is accepted, and the KV bytes per token count both models."""
    plain = LLM(model=tiny_chat_model, dtype="float32", num_kv_blocks=128, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    client = draft_server.client()
    for prompt, text in zip(PROMPTS, expected):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == text
    m = draft_server.metrics()
    drafted = draft_server.value(m, "kvflow:spec_decode_num_draft_tokens_total")
    accepted = draft_server.value(m, "kvflow:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and accepted >= 0.9 * drafted
    assert draft_server.value(m, "kvflow:kv_cache_bytes_per_token") == \
        2 * plain.engine.core.kv_bytes_per_token
    assert draft_server.value(m, "kvflow:kv_cache_usage_perc") == 0
