"""Request keeps its attributes in slots: a fixed-size record whatever their number.

CPython 3.11 shares one key table among a class's instance dicts only up to 29 attributes;
from the 30th on, every instance carries a private combined dict (1,584 bytes for 30 keys) and
attribute loads and stores leave the interpreter's fast paths. That cliff made the decode
step's host time 1.15x (benchmarks/host_overhead.py, docs/benchmarks.md session 47).
"""

from __future__ import annotations

import sys

import pytest

from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def _request() -> Request:
    return Request("r0", [1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=1),
                   eos_token_id=2, priority=1, cache_salt="s")


def test_request_has_no_instance_dict():
    request = _request()
    assert not hasattr(request, "__dict__")
    # header (16 bytes) + GC header (16) + one pointer per slot: 8 bytes each
    assert sys.getsizeof(request) == 32 + 8 * len(Request.__slots__)


def test_every_slot_is_set_by_init():
    request = _request()
    values = {name: getattr(request, name) for name in Request.__slots__}
    assert values["request_id"] == "r0" and values["parent_id"] == "r0"
    assert values["all_token_ids"] == [1, 2, 3] and values["num_computed_tokens"] == 0
    assert values["min_stop_len"] == 3 and values["max_num_tokens"] == 7
    assert values["prompt_logprobs"] == [None] and values["num_cached_tokens"] == -1


def test_unknown_attribute_is_refused():
    with pytest.raises(AttributeError):
        _request().not_a_field = 1
