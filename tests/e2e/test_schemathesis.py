"""Fuzzing the server with schemathesis (https://schemathesis.readthedocs.io): requests made
from its own OpenAPI schema (valid and invalid bodies, streamed or not) on the tiny Llama.
Every response must come within the timeout and be below 500; the server must still serve
and hold no KV block afterwards.

``KVFLOW_FUZZ_EXAMPLES`` sets the examples per operation (default 20, well under a minute in
all); ``benchmarks/fuzz_server.sh`` runs a larger campaign (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from tests.e2e.conftest import RUNTIME_LORA_ENV

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "4",
        "--max-model-len", "128", "--max-num-seqs", "8"]
EXAMPLES = int(os.environ.get("KVFLOW_FUZZ_EXAMPLES", "20"))
TIMEOUT_S = 60.0  # a reply slower than this counts as a hang


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, RUNTIME_LORA_ENV)]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# Every operation of the schema, fuzzed with valid (positive) and invalid (negative) data.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/responses/{response_id}/input_items"),
              ("POST", "/v1/responses/{response_id}/cancel"),
              ("POST", "/v1/embeddings"), ("POST", "/pooling"), ("POST", "/v1/score"),
              ("POST", "/score"), ("POST", "/v1/rerank"), ("POST", "/rerank"),
              ("POST", "/v2/rerank"), ("POST", "/classify"), ("POST", "/v1/classify"),
              ("POST", "/v1/load_lora_adapter"),
              ("POST", "/v1/unload_lora_adapter"), ("GET", "/v1/models"), ("GET", "/v1/models/{model}"),
              ("GET", "/health"), ("GET", "/version"),
              ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/ping"), ("POST", "/ping"), ("POST", "/invocations")]
BODYLESS = ("/cancel", "/ping")  # POSTs that take no body
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
CASES = [(method, path, mode) for method, path in OPERATIONS for mode in MODES
         if (method == "POST" and not path.endswith(BODYLESS)) or
         mode is GenerationMode.POSITIVE]  # a GET, and BODYLESS, take no body


def test_operations_list_is_the_schema(api_schema):
    found = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("method,path,mode", CASES,
                         ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_server_error_and_no_hang(server, api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(base_url=server.url, timeout=TIMEOUT_S)
        assert response.status_code < 500, (method, path, case.body, response.text)

    run()


def test_server_still_serves_and_holds_no_block(server):
    """After the fuzzing, the engine is healthy and every usable KV block is free."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "the quick", "max_tokens": 2})
    assert resp.status_code == 200
    m = server.metrics()
    assert server.value(m, "kvflow:kv_cache_free_blocks") == \
        server.value(m, "kvflow:kv_cache_usable_blocks") == 127
