"""Service levels over HTTP: the step-time model's error on /metrics, admission control's 503s,
and the client a request is accounted to under ``--policy fair`` (completions, chat and
embeddings alike).

The server runs the tiny chat model with ``--policy fair``, server-wide targets loose enough
that ordinary requests always meet them, and admission control.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from types import SimpleNamespace

import httpx
from starlette.requests import Request

from kvflow.config import ServerConfig
from kvflow.core.slo_planner import COLD_STEPS
from kvflow.entrypoints.protocol import CompletionRequest, EmbeddingRequest
from kvflow.entrypoints.serving_base import OpenAIServing
from kvflow.entrypoints.serving_embedding import OpenAIServingEmbedding
from tests.e2e.conftest import post_at_once

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256", "--block-size", "4",
        "--policy", "fair", "--target-ttft-ms", "60000", "--target-tpot-ms", "10000",
        "--admission-control"]
PROMPT = "the quick brown fox"
MIN_STEPS = 16  # StepTimeModel.min_steps


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


def complete(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body})


def test_step_time_model_error_on_metrics_and_refusals(server):
    """Four requests of 8 tokens one after another are 32 steps; the last one's duration is
    measured when the next step starts, so 31 are measured; the first COLD_STEPS are not
    learnt and every one after the next 16 (the model's warm-up) was predicted first: 11
    predictions, with a finite, positive error. Then a request with a 1 us TTFT target is admitted by the idle engine; of six sent
    at once, those that find the engine busy are refused (503, Retry-After), counted, and
    leave no KV block held."""
    for _ in range(4):
        assert complete(server).status_code == 200
    m = server.metrics()
    predicted = server.value(m, "kvflow:step_time_model_predictions_total")
    assert predicted == 4 * 8 - 1 - COLD_STEPS - MIN_STEPS
    abs_error = server.value(m, "kvflow:step_time_model_abs_error_seconds")
    rel_error = server.value(m, "kvflow:step_time_model_rel_error")
    assert 0 < abs_error < 1 and 0 < rel_error < math.inf
    assert complete(server, target_ttft_ms=0.001).status_code == 200  # an idle engine admits
    burst = post_at_once(f"{server.url}/v1/completions", {
        "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "target_ttft_ms": 0.001}, 6)
    refused = [r for r in burst if r.status_code == 503]
    assert refused and all(r.status_code == 200 for r in burst if r not in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert complete(server).status_code == 200  # and it keeps serving
    m = server.metrics()
    assert server.value(m, "kvflow:requests_rejected_total") == len(refused)
    assert server.value(m, "kvflow:kv_cache_free_blocks") == \
        server.value(m, "kvflow:kv_cache_usable_blocks")


def _raw(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode())
                                                for k, v in headers.items()]})


def test_client_is_the_user_field_else_an_api_key_digest():
    body = CompletionRequest(prompt="x")
    assert OpenAIServing.client_id(CompletionRequest(prompt="x", user="alice"),
                                   _raw({"Authorization": "Bearer k1"})) == "alice"
    one = OpenAIServing.client_id(body, _raw({"Authorization": "Bearer k1"}))
    two = OpenAIServing.client_id(body, _raw({"Authorization": "Bearer k2"}))
    assert one.startswith("key:") and len(one) == 4 + 16 and one != two and "k1" not in one
    assert OpenAIServing.client_id(body, _raw({})) == ""


class _EmbeddingEngine:
    """What /v1/embeddings asks of the engine, recording each queued input's client."""

    task, is_healthy, num_waiting_requests, max_model_len, tokenizer = "embed", True, 0, 64, None
    vocab_size = 100  # token-id inputs are checked against it (input.N)
    processor = SimpleNamespace(pooler=None)  # no pooler config: serves its task alone

    def __init__(self) -> None:
        self.clients: list[str] = []

    def add_pooling_request(self, request_id, text, ids, params, client_id="", priority=0):
        self.clients.append(client_id)
        return _OneEmbedding(request_id)

    @staticmethod
    async def admitted(stream) -> None:
        return None

    def abort(self, request_id: str) -> None:
        pass


class _OneEmbedding:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.admitted = request_id, None

    async def __aiter__(self):
        yield SimpleNamespace(outputs=SimpleNamespace(embedding=[1.0, 0.0]))


def test_embeddings_are_accounted_to_their_client_like_completions():
    """/v1/embeddings identifies its sender as completions and chat do (the ``user`` field,
    else the API key's digest): every input was queued as the anonymous client ""."""
    engine = _EmbeddingEngine()
    handler = OpenAIServingEmbedding(engine, ServerConfig(), "m",
                                     SimpleNamespace(resolve=lambda model: None))

    async def embed(headers: dict[str, str], **body) -> None:
        raw = _raw(headers)
        raw._receive = lambda: asyncio.Event().wait()  # the client stays connected
        reply = await handler.create_embedding(EmbeddingRequest(input=[[5, 6], [7]], **body),
                                               raw)
        assert reply.status_code == 200

    asyncio.run(embed({"Authorization": "Bearer k1"}, user="alice"))
    asyncio.run(embed({"Authorization": "Bearer k1"}))
    asyncio.run(embed({}))
    digest = "key:" + hashlib.sha256(b"k1").hexdigest()[:16]
    assert engine.clients == ["alice", "alice", digest, digest, "", ""]


def test_embedding_inputs_are_logged_under_enable_log_requests(caplog):
    """``--enable-log-requests`` logs pooling requests as it logs generation ones (one line
    per input: its id, its ids cut to ``--max-log-len``, its PoolingParams); without the flag
    nothing is logged."""
    for flags, expected in [({"enable_log_requests": True, "max_log_len": 1}, 2), ({}, 0)]:
        handler = OpenAIServingEmbedding(_EmbeddingEngine(), ServerConfig(**flags), "m",
                                         SimpleNamespace(resolve=lambda model: None))

        async def embed() -> None:
            raw = _raw({})
            raw._receive = lambda: asyncio.Event().wait()  # the client stays connected
            reply = await handler.create_embedding(  # noqa: B023 (run at once)
                EmbeddingRequest(input=[[5, 6], [7]], request_id="lg"), raw)
            assert reply.status_code == 200

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvflow.entrypoints.serving_base"):
            asyncio.run(embed())
        lines = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
        assert len(lines) == expected, lines
        if expected:
            assert lines[0].startswith("received request embd-lg-")  # + a unique suffix
            assert "-0: prompt: None, params: PoolingParams(" in lines[0]
            assert lines[0].endswith("prompt_token_ids: [5], lora_request: None")
