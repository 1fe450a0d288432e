"""A request's id from its ``X-Request-Id`` header, as vLLM 0.32 takes it
(``OpenAIServing._base_request_id``: the header, else the body's ``request_id``, else a random
id; the reply's ``id`` is ``cmpl-`` / ``chatcmpl-`` / ``embd-`` ... + it). kvflow read the body
field only, so a client tracing its requests by the header (a gateway setting it on every
request) got replies named by random ids. Served: tests/e2e/test_openai_fields.py
(``request_id``)."""

from __future__ import annotations

import re

import pytest
from starlette.requests import Request

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.serving_base import request_ids


def _raw(*headers: tuple[str, str]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers]})


def test_header_names_the_reply_and_wins_over_the_body_field():
    reply, engine = request_ids("cmpl", None, _raw(("X-Request-Id", "gw-7")))
    assert reply == "cmpl-gw-7" and re.fullmatch(r"cmpl-gw-7-[0-9a-f]{32}", engine)
    reply, engine = request_ids("chatcmpl", "body-1", _raw(("x-request-id", "gw-8")))
    assert reply == "chatcmpl-gw-8" and engine.startswith("chatcmpl-gw-8-")
    # no header (or an empty one): the body's field, else a random id
    assert request_ids("embd", "body-1", _raw())[0] == "embd-body-1"
    assert request_ids("embd", "body-1", _raw(("X-Request-Id", "")))[0] == "embd-body-1"
    reply, engine = request_ids("cmpl", None, _raw())
    assert reply == engine and re.fullmatch(r"cmpl-[0-9a-f]{32}", reply)


def test_two_requests_with_one_header_stay_two_in_the_engine():
    first, second = (request_ids("cmpl", None, _raw(("X-Request-Id", "same"))) for _ in "ab")
    assert first[0] == second[0] == "cmpl-same" and first[1] != second[1]


def test_an_overlong_header_is_a_400_naming_it():
    with pytest.raises(OpenAIError) as raised:
        request_ids("cmpl", None, _raw(("X-Request-Id", "x" * 257)))
    error = raised.value
    assert (error.status, error.param, error.code) == (400, "X-Request-Id", "invalid_value")
    assert request_ids("cmpl", None, _raw(("X-Request-Id", "x" * 256)))[0] == \
        "cmpl-" + "x" * 256
