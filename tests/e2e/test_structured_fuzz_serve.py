"""The structured-output fuzz's grammar kinds (``tests/structured_fuzz_cases.py``) through the
server: each kind's request (``structured_outputs``, n=4, temperature 1.5), sent all at once,
is answered 200 (no 5xx, none hangs past its max_tokens), and each finished choice passes the
kind's oracle, a cut one its prefix oracle, with no U+FFFD in either."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.test_openai_tiny import MODEL, SERVER_ARGS
from tests.structured_fuzz_cases import CASES, FuzzCase

MAX_TOKENS = 40


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), SERVER_ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """test_openai_tiny.py's server (``start_server.shared``)."""
    return start_server.shared(tiny_chat_model, SERVER_ARGS)


def _post(server, case: FuzzCase) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a b a b", "max_tokens": MAX_TOKENS, "n": 4,
            "temperature": 1.5, "seed": 7, "structured_outputs": case.constraint}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def test_every_kind_is_served_and_matches(server):
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda case: _post(server, case), CASES))
    for case, reply in zip(CASES, replies):
        assert reply.status_code == 200, (case.name, reply.text)
        body = reply.json()
        assert len(body["choices"]) == 4
        for choice in body["choices"]:
            text, reason = choice["text"], choice["finish_reason"]
            assert reason in ("stop", "length"), (case.name, choice)
            assert "\ufffd" not in text or reason == "length", (case.name, text)
            if reason == "stop":
                case.check(text)
            elif case.is_prefix is not None:
                assert case.is_prefix(text.rstrip("\ufffd")), (case.name, text)
        assert body["usage"]["completion_tokens"] <= 4 * MAX_TOKENS
