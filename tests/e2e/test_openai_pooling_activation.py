"""vLLM's ``activation`` (0.10) / ``use_activation`` (0.11.1) over HTTP: false answers a head
task's raw logits instead of their softmax / sigmoid on /classify, /pooling (classify and
token_classify), /score and /rerank, against transformers' logits (the default against
torch.softmax / sigmoid of them): a tiny random Qwen2ForSequenceClassification classify server
(which also serves token_classify: its score head on every token) and a BERT cross-encoder
score server; on an embedding server vLLM 0.32's name of normalize (/pooling embed and
token_embed, /v1/embeddings' use_activation) against transformers' last hidden states; the
400s naming the field (the two names disagreeing, normalize disagreeing with it on an
embedding task, a non-bool, an embedding model's cosine scores, /v1/embeddings' activation,
which it does not take); vLLM
0.10's reward-model ``softmax`` on /pooling's token_classify (refused on other tasks and
endpoints); every KV block free afterwards."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.e2e.conftest import ready_side_by_side
from tests.e2e.test_openai_score import BERT_ARGS as SCORE_ARGS
from tests.e2e.test_openai_token_pooling import TE_ARGS, bare_decoder_model, te_server
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder
from tests.models.test_pooling_activation import hf_per_token_logits
from tests.models.token_models import hf_token_outputs

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "16",
        "--num-kv-blocks", "64"]
NAMES = ("cls", "ce", "emb")
LONG = " ".join(TEXTS)  # ~40 tokens: three prefill chunks of 16
# the pairs that fit the shared cross-encoder server's --max-model-len 16 (all but the 2nd)
DOCS = [DOCUMENTS[0], *DOCUMENTS[2:]]
ATOL = 1e-5  # float32 rounding of two implementations (see tests/models/test_classify.py)
RAW = {"atol": ATOL, "rtol": 1e-5}  # raw logits are not in (0, 1): rounding relative to size


def _cls_model(built_models) -> str:
    return built_models("act_cls_qwen2", lambda f: build_decoder_classifier(f, "Qwen2", 3))[0]


def prestart_servers(fixture):
    """This module's own server and the session's bare-decoder embedding server
    (test_openai_token_pooling.py's; see ``prestart_servers`` in conftest.py)."""
    built_models = fixture("built_models")
    return [(_cls_model(built_models), [*ARGS, "--task", "classify", "--served-model-name",
                                        "cls"], None),
            (bare_decoder_model(built_models), TE_ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request, built_models):
    """{name: (server, folder)} for ``NAMES``: "cls" this module's; "ce" the session's BERT
    cross-encoder server (test_openai_score.py's and test_openai_classify.py's,
    ``start_server.shared``) and "emb" the session's bare-decoder embedding server
    (test_openai_token_pooling.py's)."""
    cls = start_server.declared(request, 0, wait=False)
    ce_folder = built_models("ce_bert", lambda f: build_cross_encoder(f, "Bert", 1))[0]
    shared = {"ce": (start_server.shared(ce_folder, SCORE_ARGS), ce_folder),
              "emb": (te_server(start_server, built_models), bare_decoder_model(built_models))}
    with ready_side_by_side(cls):
        yield {"cls": (cls, _cls_model(built_models)), **shared}


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
                              for d in DOCS])
    body = {"text_1": QUERY, "text_2": DOCS}
    default = _post(server, "/v1/score", body).json()["data"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in default]),
                               torch.sigmoid(logits), atol=ATOL, rtol=0)
    raw = _post(server, "/score", {**body, "activation": False}).json()["data"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in raw]), logits, **RAW)
    ranked = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS,
                                          "use_activation": False}).json()["results"]
    assert [r["index"] for r in ranked] == logits.argsort(descending=True).tolist()
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in ranked]),
                               logits.sort(descending=True).values, **RAW)


def test_embedding_use_activation_is_normalize(servers):
    """vLLM 0.32 reads use_activation on the embedding tasks as their L2 normalization
    (was: a 400 naming it): false gives transformers' raw last hidden state (the last
    token's on embed, every token's on token_embed), true / unset the normalized ones."""
    server, folder = servers["emb"]
    rows = hf_token_outputs(folder, TEXTS[0], "token_embed")
    unit = torch.nn.functional.normalize(rows, dim=-1)
    for path, extra in (("/v1/embeddings", {}), ("/pooling", {}),
                        ("/pooling", {"activation": False})):
        body = {"input": TEXTS[0], **({"use_activation": False} if not extra else extra)}
        got = _post(server, path, body).json()["data"][0]
        torch.testing.assert_close(torch.tensor(got.get("embedding", got.get("data"))),
                                   rows[-1], **RAW)
    got = _post(server, "/v1/embeddings", {"input": TEXTS[0], "use_activation": True}).json()
    torch.testing.assert_close(torch.tensor(got["data"][0]["embedding"]), unit[-1], **RAW)
    for flag, ref in ((False, rows), (True, unit)):
        got = _post(server, "/pooling", {"input": TEXTS[0], "task": "token_embed",
                                         "use_activation": flag}).json()["data"][0]["data"]
        torch.testing.assert_close(torch.tensor(got), ref, **RAW)


@pytest.mark.parametrize("name, path, body, param, code", [
    ("cls", "/classify", {"activation": True, "use_activation": False}, "activation",
     "invalid_value"),
    ("cls", "/classify", {"activation": "false"}, "activation", None),
    ("ce", "/v1/score", {"text_1": "a", "text_2": "b", "activation": False,
                         "use_activation": True}, "activation", "invalid_value"),
    ("emb", "/pooling", {"activation": False, "normalize": True}, "activation",
     "invalid_value"),
    ("emb", "/pooling", {"task": "token_embed", "use_activation": True, "normalize": False},
     "use_activation", "invalid_value"),
    ("emb", "/v1/embeddings", {"use_activation": True, "normalize": False}, "use_activation",
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
