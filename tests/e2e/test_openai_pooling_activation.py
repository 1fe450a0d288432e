"""vLLM's ``activation`` (0.10) / ``use_activation`` (0.11.1) over HTTP: false answers a head
task's raw logits instead of their softmax / sigmoid on /classify, /pooling (classify and
token_classify), /score and /rerank, against transformers' logits (the default against
torch.softmax / sigmoid of them): a tiny random Qwen2ForSequenceClassification classify server
(which also serves token_classify: its score head on every token) and a BERT cross-encoder
score server; the 400s naming the field (the two names disagreeing, a non-bool, an embedding
task, an embedding model's cosine scores, /v1/embeddings, which does not take it); vLLM
0.10's reward-model ``softmax`` on /pooling's token_classify (refused on other tasks and
endpoints); every KV block free afterwards."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.e2e.conftest import ready_side_by_side
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder
from tests.models.test_pooling_activation import hf_per_token_logits
from tests.models.token_models import build_bare_decoder

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "16",
        "--num-kv-blocks", "64"]
NAMES = ("cls", "ce", "emb")
SERVER_ARGS = {"cls": [*ARGS, "--task", "classify"], "emb": ARGS,
               "ce": ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "64"]}
LONG = " ".join(TEXTS)  # ~40 tokens: three prefill chunks of 16
ATOL = 1e-5  # float32 rounding of two implementations (see tests/models/test_classify.py)
RAW = {"atol": ATOL, "rtol": 1e-5}  # raw logits are not in (0, 1): rounding relative to size


def _models(built_models) -> dict[str, str]:
    return {"cls": built_models("act_cls_qwen2", lambda f: build_decoder_classifier(
                f, "Qwen2", 3))[0],
            "ce": built_models("act_ce_bert", lambda f: build_cross_encoder(f, "Bert", 1))[0],
            "emb": built_models("act_emb_llama", build_bare_decoder)[0]}


def prestart_servers(fixture):
    """This module's servers (see ``prestart_servers`` in conftest.py)."""
    models = _models(fixture("built_models"))
    return [(models[name], [*SERVER_ARGS[name], "--served-model-name", name], None)
            for name in NAMES]


@pytest.fixture(scope="module")
def servers(start_server, request, built_models):
    """{name: (server, folder)} for ``NAMES``, up side by side."""
    models = _models(built_models)
    started = [start_server.declared(request, i, wait=False) for i in range(len(NAMES))]
    with ready_side_by_side(*started):
        yield {name: (server, models[name]) for name, server in zip(NAMES, started)}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _free_blocks(server) -> float:
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


def test_classify_and_pooling_raw_logits(servers):
    server, folder = servers["cls"]
    free = _free_blocks(server)
    logits = hf_logits(folder, TEXTS[:3])
    default = _post(server, "/classify", {"input": TEXTS[:3]}).json()["data"]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in default]),
                               torch.softmax(logits, -1), atol=ATOL, rtol=0)
    for field in ("activation", "use_activation"):
        data = _post(server, "/classify", {"input": TEXTS[:3], field: False}).json()["data"]
        torch.testing.assert_close(torch.tensor([d["probs"] for d in data]), logits, **RAW)
        assert [d["label"] for d in data] == [f"LABEL_{int(i)}" for i in logits.argmax(-1)]
        pooled = _post(server, "/pooling", {"input": TEXTS[:3], "task": "classify",
                                            field: False}).json()["data"]
        torch.testing.assert_close(torch.tensor([d["data"] for d in pooled]), logits, **RAW)
    # token_classify on the sequence classifier: its score head on every token
    ref = hf_per_token_logits(folder, LONG)
    rows = _post(server, "/pooling", {"input": LONG, "task": "token_classify"}).json()
    torch.testing.assert_close(torch.tensor(rows["data"][0]["data"]), torch.softmax(ref, -1),
                               atol=ATOL, rtol=0)
    raw = _post(server, "/pooling", {"input": LONG, "task": "token_classify",
                                     "activation": False}).json()
    torch.testing.assert_close(torch.tensor(raw["data"][0]["data"]), ref, **RAW)
    # vLLM 0.10's reward-model softmax: the same switch, on the per-token task
    raw = _post(server, "/pooling", {"input": LONG, "task": "token_classify",
                                     "softmax": False}).json()
    torch.testing.assert_close(torch.tensor(raw["data"][0]["data"]), ref, **RAW)
    assert _free_blocks(server) == free


def test_score_and_rerank_raw_logits(servers):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, folder = servers["ce"]
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]
                              for d in DOCUMENTS])
    body = {"text_1": QUERY, "text_2": DOCUMENTS}
    default = _post(server, "/v1/score", body).json()["data"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in default]),
                               torch.sigmoid(logits), atol=ATOL, rtol=0)
    raw = _post(server, "/score", {**body, "activation": False}).json()["data"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in raw]), logits, **RAW)
    ranked = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                          "use_activation": False}).json()["results"]
    assert [r["index"] for r in ranked] == logits.argsort(descending=True).tolist()
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in ranked]),
                               logits.sort(descending=True).values, **RAW)


@pytest.mark.parametrize("name, path, body, param, code", [
    ("cls", "/classify", {"activation": True, "use_activation": False}, "activation",
     "invalid_value"),
    ("cls", "/classify", {"activation": "false"}, "activation", None),
    ("ce", "/v1/score", {"text_1": "a", "text_2": "b", "activation": False,
                         "use_activation": True}, "activation", "invalid_value"),
    ("emb", "/pooling", {"activation": False}, "activation", "invalid_value"),
    ("emb", "/pooling", {"task": "token_embed", "use_activation": True}, "use_activation",
     "invalid_value"),
    ("emb", "/v1/score", {"text_1": "a", "text_2": "b", "activation": False}, "activation",
     "invalid_value"),
    ("emb", "/v1/embeddings", {"activation": False}, "activation", "unknown_parameter"),
    ("cls", "/pooling", {"task": "classify", "softmax": False}, "softmax", "invalid_value"),
    ("emb", "/pooling", {"softmax": True}, "softmax", "invalid_value"),
    ("cls", "/pooling", {"task": "token_classify", "softmax": True, "activation": False},
     "softmax", "invalid_value"),
    ("cls", "/classify", {"softmax": False}, "softmax", "unknown_parameter"),
])
def test_activation_refusals(servers, name, path, body, param, code):
    server, _ = servers[name]
    free = _free_blocks(server)
    if "text_1" not in body:
        body = {"input": "paris", **body}
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert code is None or error["code"] == code, error
    assert _free_blocks(server) == free
