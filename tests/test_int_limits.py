"""The integer request fields are bounded the same way offline (``SamplingParams``,
``BeamSearchParams``, ``LLM.generate``'s priority) and on the server (the OpenAI request
models' ``le`` / ``ge``): each bound is read from the server's schema, the value at it is
taken offline and the next one refused with a ValueError naming the field and the bound.
``SamplingParams(stream_interval=2**63)`` and the other count fields past 2**31 - 1 were
taken offline (a top_k of 2**63 overflows int64 in the sampler's tensors), while the server
refused them with a 400."""

from __future__ import annotations

import pydantic
import pytest
from annotated_types import Ge, Le

from kvflow.config.scheduler import check_priority
from kvflow.entrypoints import protocol
from kvflow.entrypoints.protocol.responses_api import ResponsesRequest
from kvflow.sampling_params import BeamSearchParams, SamplingParams


def schema_bound(model: type[pydantic.BaseModel], name: str, kind: type = Le) -> int:
    """The ``le`` (or ``ge``) bound the server's request ``model`` puts on field ``name``."""
    (bound,) = [getattr(m, kind.__name__.lower()) for m in model.model_fields[name].metadata
                if isinstance(m, kind)]
    return bound


# SamplingParams field -> (the request model, its field of that meaning)
FIELDS = {"n": (protocol.CompletionRequest, "n"),
          "top_k": (protocol.CompletionRequest, "top_k"),
          "max_tokens": (protocol.CompletionRequest, "max_tokens"),
          "min_tokens": (protocol.CompletionRequest, "min_tokens"),
          "logprobs": (protocol.CompletionRequest, "logprobs"),
          "prompt_logprobs": (protocol.CompletionRequest, "prompt_logprobs"),
          "stream_interval": (protocol.CompletionRequest, "stream_interval"),
          "truncate_prompt_tokens": (protocol.CompletionRequest, "truncate_prompt_tokens"),
          "seed": (protocol.CompletionRequest, "seed")}


def _params(name: str, value: int) -> SamplingParams:
    return SamplingParams(**{name: value}, **({"max_tokens": None} if name == "min_tokens"
                                              else {}))


@pytest.mark.parametrize("name", FIELDS)
def test_sampling_params_bound_is_the_servers(name):
    model, field = FIELDS[name]
    bound = schema_bound(model, field)
    assert bound in (2**31 - 1, 2**63 - 1)  # the hand-picked limits, read from the schema
    assert getattr(_params(name, bound), name) == bound
    for value in (bound + 1, 2**63, 2**64 + 5):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}={value} is invalid: "
                                             rf"it must .*{bound}"):
            _params(name, value)
        with pytest.raises(pydantic.ValidationError):  # the server's 400
            model.model_validate({"prompt": "x", field: value})


def test_stream_interval_of_2_63_is_refused():
    """The brief's case: an interval past 2**31 - 1 is no interval any stream reaches."""
    with pytest.raises(ValueError, match=r"stream_interval=9223372036854775808 is invalid: "
                                         r"it must be <= 2147483647"):
        SamplingParams(stream_interval=2**63)


def test_seed_low_bound_is_the_servers():
    low = schema_bound(protocol.CompletionRequest, "seed", Ge)
    assert low == -2**63 and SamplingParams(seed=low).seed == low
    with pytest.raises(ValueError, match=r"SamplingParams\.seed=.* signed 64-bit"):
        SamplingParams(seed=low - 1)


def test_chat_and_responses_bound_the_same_fields():
    """Chat's ``top_logprobs`` (offline ``logprobs``) and the Responses request's ``top_k``
    carry the bounds of the fields they become."""
    assert schema_bound(protocol.ChatCompletionRequest, "top_logprobs") == \
        schema_bound(protocol.CompletionRequest, "logprobs") == 2**31 - 1
    assert schema_bound(ResponsesRequest, "top_k") == \
        schema_bound(protocol.CompletionRequest, "top_k")


def test_priority_bounds_are_the_servers():
    high = schema_bound(protocol.CompletionRequest, "priority")
    low = schema_bound(protocol.CompletionRequest, "priority", Ge)
    for value in (low, high):
        check_priority(value, "priority")
    for value in (low - 1, high + 1, 2**63):
        with pytest.raises(ValueError, match=rf"priority={value} is invalid: it must be in "
                                             rf"\[{low}, {high}\]"):
            check_priority(value, "priority")


@pytest.mark.parametrize("value", [None, "1", 1.5, True])
def test_priority_of_another_type_is_named(value):
    """The engine's add_request checks a priority with this rule alone: a non-integer is a
    ValueError naming it, not a TypeError from the bound's comparison."""
    with pytest.raises(ValueError, match=r"priority=.* is invalid: it must be an integer"):
        check_priority(value, "priority")


def test_beam_search_max_tokens_bound_is_the_servers():
    bound = schema_bound(protocol.CompletionRequest, "max_tokens")
    assert BeamSearchParams(beam_width=2, max_tokens=bound).max_tokens == bound
    with pytest.raises(ValueError, match=rf"BeamSearchParams\.max_tokens={bound + 1} is "
                                         rf"invalid: it must be <= {bound}"):
        BeamSearchParams(beam_width=2, max_tokens=bound + 1)
