"""Grammar compiles past their time limit keep their thread (a compile in C cannot be
stopped), so ``--structured-output-max-compile-threads`` caps them: once timed-out compiles
fill it, a constrained request that needs a new compile is refused at once with a 429
(``grammar_compiles_busy``, ``Retry-After``), unconstrained requests are served meanwhile, and
when the slow compile ends constrained requests are served again.

The slow grammar is ``compile_pool``'s: bounded repetitions of a rule cost xgrammar seconds
for SmolLM2's 49,152 tokens (``root{2,20}``: 5 s measured on 2 cores; the tiny test
tokenizer's 320 tokens compile it in under a millisecond), against a 0.5 s limit and a cap
of one thread."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import SMOLLM2 as MODEL
from tests.e2e.conftest import SMOLLM2_ARGS

pytestmark = pytest.mark.slow

ARGS = [*SMOLLM2_ARGS, "--structured-output-compile-timeout", "0.5",
        "--structured-output-compile-threads", "1", "--structured-output-max-compile-threads", "1"]
SLOW = 'root ::= [^"\\\\] | root{2,20}'


def prestart_servers(fixture):
    """This module's server, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(MODEL, ARGS, None)]


def _post(server, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def test_timed_out_compiles_at_the_cap_get_429_until_they_end(server):
    began = time.monotonic()
    slow = _post(server, structured_outputs={"grammar": SLOW})
    assert slow.status_code == 400, slow.text  # past the 0.5 s limit; its thread runs on
    assert slow.json()["error"]["message"].startswith("the grammar did not compile within 0.5 s")
    busy = _post(server, structured_outputs={"regex": "[a-c]{3}"})
    assert time.monotonic() - began < 4, "the slow compile may have ended already"
    assert busy.status_code == 429, busy.text
    assert busy.headers["Retry-After"] == "1"
    error = busy.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "rate_limit_exceeded", "grammar_compiles_busy", "structured_outputs.regex")
    assert "--structured-output-max-compile-threads 1" in error["message"]
    plain = _post(server)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 90
    while (again := _post(server, structured_outputs={"regex": "[a-c]{3}"})).status_code == 429:
        assert time.monotonic() < deadline, "the slow compile never ended"
        time.sleep(0.5)
    assert again.status_code == 200, again.text
    choice = again.json()["choices"][0]
    assert len(choice["text"]) == 3 and set(choice["text"]) <= set("abc"), choice
