"""POST /pooling with vLLM's per-token tasks over HTTP, against transformers: ``kvflow serve``
with a tiny random LlamaForTokenClassification (``task`` token_classify, or left out: the
server's task) gives each input's softmax(logits) per token as ``data`` [tokens][num_labels],
and a bare LlamaModel embedding server gives ``task: token_embed`` rows [tokens][hidden]
(L2-normalized per token, ``normalize: false`` raw); prompts longer than
``--max-num-batched-tokens`` (chunked prefill); ``encoding_format`` base64 and bytes; a task
the model cannot do is a 400 naming ``task``; every KV block free afterwards."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch

from tests.e2e.conftest import ready_side_by_side
from tests.models.classifier_models import TEXTS
from tests.models.token_models import build_bare_decoder, build_token_classifier, hf_token_outputs

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "16",
        "--num-kv-blocks", "64"]
NAMES = ("tc", "te")
LONG = " ".join(TEXTS)  # ~40 tokens: three chunks of 16
ATOL = 1e-5


TE_ARGS = [*ARGS, "--served-model-name", "te"]


def _models(built_models) -> dict[str, str]:
    return {"tc": built_models("tokcls_llama", lambda f: build_token_classifier(
                f, "Llama", 3))[0],
            "te": bare_decoder_model(built_models)}


def bare_decoder_model(built_models) -> str:
    """The tiny bare LlamaModel embedder's folder (``build_bare_decoder``), once per session."""
    return built_models("tokemb_llama", build_bare_decoder)[0]


def te_server(start_server, built_models):
    """The session's server of the bare decoder with ``TE_ARGS`` (``start_server.shared``;
    test_openai_pooling_activation.py's embedding server, started ahead by that module)."""
    return start_server.shared(bare_decoder_model(built_models), TE_ARGS)


def prestart_servers(fixture):
    """This module's own server (see ``prestart_servers`` in conftest.py); "te" is the
    session's (:func:`te_server`), declared by test_openai_pooling_activation.py."""
    return [(_models(fixture("built_models"))["tc"], [*ARGS, "--served-model-name", "tc"], None)]


@pytest.fixture(scope="module")
def servers(start_server, request, built_models):
    """{name: (server, folder)} for ``NAMES``: "tc" this module's, "te" the session's."""
    models = _models(built_models)
    tc = start_server.declared(request, 0, wait=False)
    te = te_server(start_server, built_models)
    with ready_side_by_side(tc):
        yield {"tc": (tc, models["tc"]), "te": (te, models["te"])}


def _post(server, body: dict, path: str = "/pooling") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _free_blocks(server) -> float:
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


def test_token_classify_gives_each_tokens_probabilities(servers):
    server, folder = servers["tc"]
    free = _free_blocks(server)
    texts = [TEXTS[1], LONG]
    expected = [torch.softmax(hf_token_outputs(folder, t, "token_classify"), dim=-1)
                for t in texts]
    assert expected[1].shape[0] > 32
    for extra in ({}, {"task": "token_classify"}):
        resp = _post(server, {"input": texts, **extra})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        tokens = sum(e.shape[0] for e in expected)
        assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0,
                                 "total_tokens": tokens}
        for d, ref in zip(body["data"], expected):
            assert d["object"] == "pooling" and len(d["data"]) == ref.shape[0]
            torch.testing.assert_close(torch.tensor(d["data"]), ref, atol=ATOL, rtol=0)
    data = _post(server, {"input": texts, "encoding_format": "base64"}).json()["data"]
    for d, ref in zip(data, expected):
        flat = np.frombuffer(base64.b64decode(d["data"]), dtype=np.float32)
        torch.testing.assert_close(torch.from_numpy(flat.copy()).view(-1, 3), ref,
                                   atol=ATOL, rtol=0)
    resp = _post(server, {"input": texts, "encoding_format": "bytes"})
    items = json.loads(resp.headers["metadata"])["data"]
    assert [i["shape"] for i in items] == [list(e.shape) for e in expected]
    last = np.frombuffer(resp.content[items[1]["start"]:items[1]["end"]], dtype=np.float32)
    torch.testing.assert_close(torch.from_numpy(last.copy()).view(-1, 3), expected[1],
                               atol=ATOL, rtol=0)
    assert _free_blocks(server) == free


def test_token_embed_gives_each_tokens_hidden_state(servers):
    server, folder = servers["te"]
    free = _free_blocks(server)
    ref = hf_token_outputs(folder, LONG, "token_embed")
    for normalize, expected in ((None, torch.nn.functional.normalize(ref, dim=-1)),
                                (False, ref)):
        body = {"input": LONG, "task": "token_embed"}
        if normalize is not None:
            body["normalize"] = normalize
        resp = _post(server, body)
        assert resp.status_code == 200, resp.text
        rows = torch.tensor(resp.json()["data"][0]["data"])
        assert rows.shape == ref.shape
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)
    # the server's own task is unchanged: one vector, the last token's row
    vector = _post(server, {"input": LONG}).json()["data"][0]["data"]
    torch.testing.assert_close(torch.tensor(vector), torch.nn.functional.normalize(
        ref[-1], dim=0), atol=1e-5, rtol=0)
    assert _free_blocks(server) == free


@pytest.mark.parametrize("name, body, path, param, code", [
    ("tc", {"task": "embed"}, "/pooling", "task", "wrong_task"),
    ("tc", {"task": "token_embed"}, "/pooling", "task", "wrong_task"),
    ("tc", {"normalize": True}, "/pooling", "normalize", "invalid_value"),
    ("tc", {}, "/v1/embeddings", "model", "wrong_task"),
    ("te", {"task": "token_classify"}, "/pooling", "task", "wrong_task"),
    ("te", {"task": "encode"}, "/pooling", "task", "unsupported_value"),
])
def test_a_task_the_model_cannot_do_is_a_400(servers, name, body, path, param, code):
    server, _ = servers[name]
    resp = _post(server, {"input": "paris", **body}, path)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)
