"""POST /classify (vLLM's shape; and /v1/classify) against transformers'
``AutoModelForSequenceClassification`` (logits -> softmax): ``kvflow serve --task classify``
with a tiny random Qwen2ForSequenceClassification (last-token pooling, named classes from
``id2label``); text and token-id inputs, ``truncate_prompt_tokens`` (and
``truncation_side``), the 400s (empty input,
token id out of the vocabulary, too long, unknown field, a score server) and a server that
keeps serving with every KV block back; /pooling's class probabilities; the /score and
/v2/rerank aliases. One engine serves both head tasks where the model
allows: a tiny random Qwen3ForCausalLM served as a Qwen3-Reranker (``--hf-overrides`` with
``classifier_from_token``, ``--task classify``) answers /v1/score, /rerank and /classify with
transformers' causal-LM P(yes) = sigmoid(logit_yes - logit_no); a score server classifies."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import TINY_CHAT_TEMPLATE
from tests.e2e.conftest import ready_side_by_side
from tests.e2e.test_openai_score import BERT_ARGS as SCORE_ARGS  # one server for both
from tests.models.classifier_models import (
    NO_TOKEN,
    TEXTS,
    YES_TOKEN,
    build_causal_reranker,
    build_decoder_classifier,
    hf_logits,
    hf_reranker_scores,
)
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "64"]
CLS_ARGS = [*ARGS, "--task", "classify", "--served-model-name", "cls", "--num-kv-blocks",
            "64", "--max-model-len", "10", "--chat-template", TINY_CHAT_TEMPLATE]
RERANKER_OVERRIDES = ('{"architectures": ["Qwen3ForSequenceClassification"], '
                      f'"classifier_from_token": ["{NO_TOKEN}", "{YES_TOKEN}"], '
                      '"is_original_qwen3_reranker": true}')
RERANKER_ARGS = [*ARGS, "--task", "classify", "--served-model-name", "rr", "--num-kv-blocks",
                 "64", "--hf-overrides", RERANKER_OVERRIDES]
ATOL = 1e-5  # float32 rounding of two implementations (see tests/models/test_classify.py)
NAMES = ("cls", "ce", "rr")


def _models(built_models) -> dict[str, str]:
    return {"cls": built_models("cls_qwen2", lambda f: build_decoder_classifier(
                f, "Qwen2", 3, id2label=LABELS))[0],
            "ce": built_models("ce_bert", lambda f: build_cross_encoder(f, "Bert", 1))[0],
            "rr": built_models("reranker_qwen3", build_causal_reranker)[0]}


def prestart_servers(fixture):
    """This module's servers (see ``prestart_servers`` in conftest.py)."""
    models = _models(fixture("built_models"))
    return [(models[name], args, None)
            for name, args in zip(NAMES, (CLS_ARGS, SCORE_ARGS, RERANKER_ARGS))]


@pytest.fixture(scope="module")
def servers(start_server, request, built_models):
    """{name: (server, folder)} for ``NAMES``, up side by side ("ce" the session's)."""
    models = _models(built_models)
    own = {name: start_server.declared(request, i, wait=False)
           for i, name in enumerate(NAMES) if name != "ce"}
    # the cross-encoder's server is kept for test_openai_score.py (its --max-model-len 16
    # fits every input sent to it here)
    ce = start_server.shared(models["ce"], SCORE_ARGS)
    with ready_side_by_side(*own.values()):
        yield {name: ({**own, "ce": ce}[name], models[name]) for name in NAMES}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _free_blocks(server) -> float:
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _hf_probs_of_ids(folder: str, ids: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return torch.stack([torch.softmax(model(input_ids=torch.tensor([i])).logits[0].float(),
                                          dim=-1) for i in ids])


def test_classify_matches_transformers(servers):
    server, folder = servers["cls"]
    texts = [t for t in TEXTS if len(_tokenizer(folder)(t)["input_ids"]) <= 10]
    assert len(texts) >= 4
    expected = torch.softmax(hf_logits(folder, texts), dim=-1)
    body = _post(server, "/classify", {"model": "cls", "input": texts}).json()
    assert body["object"] == "list" and body["model"] == "cls"
    assert body["id"].startswith("classify-") and isinstance(body["created"], int)
    got = torch.tensor([d["probs"] for d in body["data"]])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert [d["num_classes"] for d in body["data"]] == [3] * len(texts)
    assert [d["label"] for d in body["data"]] == \
        [LABELS[int(i)] for i in expected.argmax(-1)]
    assert len({d["label"] for d in body["data"]}) > 1  # the oracle's labels differ
    tokens = sum(len(_tokenizer(folder)(t)["input_ids"]) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0,
                             "total_tokens": tokens}
    # one text, one list of ids, a list of id lists; the /v1/classify alias; request_id
    ids = [_tokenizer(folder)(t)["input_ids"] for t in texts[:2]]
    for path, value, rows in [("/classify", texts[0], [0]), ("/v1/classify", ids[0], [0]),
                              ("/classify", ids, [0, 1])]:
        body = _post(server, path, {"input": value, "request_id": "r7"}).json()
        assert body["id"] == "classify-r7"
        torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]),
                                   expected[rows], atol=ATOL, rtol=0)


def test_truncate_prompt_tokens(servers):
    server, folder = servers["cls"]
    long_text = TEXTS[3]
    full = _tokenizer(folder)(long_text)["input_ids"]
    assert len(full) > 10
    # vLLM's pooling rules: a text as the tokenizer truncates it on the right and token ids
    # alike keep their first 6 (no special tokens here); truncation_side "left" their last 6
    expected = _hf_probs_of_ids(folder, [full[:6], full[-6:]])
    for value, side, row in [([long_text], None, 0), ([full], None, 0),
                             ([long_text], "left", 1), ([full], "left", 1),
                             ([full], "right", 0)]:
        body = _post(server, "/classify", {"input": value, "truncate_prompt_tokens": 6,
                                           "truncation_side": side}).json()
        torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]), expected[row],
                                   atol=ATOL, rtol=0)
        assert body["usage"]["prompt_tokens"] == 6
    assert (expected[0] - expected[1]).abs().max() > 1e-3  # the two cuts are told apart
    # -1: max_model_len (10), vLLM's reading; the text alone is refused as too long
    expected = _hf_probs_of_ids(folder, [full[:10], full[-10:]])
    for value, side, row in [([long_text], None, 0), ([full], None, 0), ([full], "left", 1)]:
        body = _post(server, "/classify", {"input": value, "truncate_prompt_tokens": -1,
                                           "truncation_side": side}).json()
        torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]), expected[row],
                                   atol=ATOL, rtol=0)
        assert body["usage"]["prompt_tokens"] == 10
    resp = _post(server, "/classify", {"input": full, "truncate_prompt_tokens": 6,
                                       "truncation_side": "middle"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncation_side"


def test_padding_max_length(servers):
    """vLLM 0.32's ``padding: "max_length"`` on /classify: the ids padded with the
    tokenizer's pad token to --max-model-len (10) and the last position (a pad) pooled, as
    vLLM does; oracle: transformers' ``score`` head on the decoder's last hidden state of the
    padded ids (its own classifier would skip the pads)."""
    from transformers import AutoModelForSequenceClassification

    server, folder = servers["cls"]
    tok = _tokenizer(folder)
    ids = tok(TEXTS[0])["input_ids"]
    assert len(ids) < 10 and tok.pad_token_id is not None
    padded = ids + [tok.pad_token_id] * (10 - len(ids))
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([padded])).last_hidden_state[0, -1]
        expected = torch.softmax(model.score(hidden).float(), dim=-1)
    body = _post(server, "/classify", {"input": TEXTS[0], "padding": "max_length"}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]), expected, atol=ATOL,
                               rtol=0)
    assert body["usage"]["prompt_tokens"] == 10
    assert (expected - _hf_probs_of_ids(folder, [ids])[0]).abs().max() > 1e-3


def test_errors_and_the_server_keeps_serving(servers):
    server, folder = servers["cls"]
    idle = _free_blocks(server)
    long_text = TEXTS[3]
    n = len(_tokenizer(folder)(long_text)["input_ids"])
    cases = [
        ({"input": ""}, "input", "empty_string"),
        ({"input": []}, "input", "empty_array"),
        ({"input": ["paris", ""]}, "input.1", "empty_string"),
        ({"input": [3, 100000]}, "input.1", "invalid_value"),  # the id's place
        ({"input": [[3], [4, -1]]}, "input.1.1", "invalid_value"),
        ({"input": long_text}, "input", "context_length_exceeded"),
        ({"input": [1] * (n + 1)}, "input", "context_length_exceeded"),
        ({"input": "paris", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
        ({"input": "paris", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", None),
        ({"input": "paris", "truncate_prompt_tokens": 11}, "truncate_prompt_tokens", None),
        ({"input": "paris", "dimensions": 2}, "dimensions", "unknown_parameter"),
    ]
    for body, param, code in cases:
        resp = _post(server, "/classify", body)
        assert resp.status_code == 400, (body, resp.text)
        error = resp.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        if code is not None:
            assert error["code"] == code, error
    resp = _post(server, "/classify", {"input": "paris", "model": "other"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    resp = _post(server, "/v1/score", {"text_1": "paris", "text_2": "city"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "wrong_task"
    body = _post(server, "/classify", {"input": "paris"}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]),
                               torch.softmax(hf_logits(folder, ["paris"])[0], -1),
                               atol=ATOL, rtol=0)
    assert _free_blocks(server) == idle > 0


def test_a_score_server_classifies(servers):
    """A one-label cross-encoder served for scores answers /classify too: its one
    probability is the sigmoid of its logit, the pair's score (vLLM's PoolerClassify)."""
    from transformers import AutoModelForSequenceClassification

    server, folder = servers["ce"]
    text = "paris is the capital"
    body = _post(server, "/classify", {"input": text}).json()
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logit = model(**_tokenizer(folder)(text, return_tensors="pt")).logits[0]
    assert [d["num_classes"] for d in body["data"]] == [1]
    torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]), torch.sigmoid(logit),
                               atol=ATOL, rtol=0)


def test_messages_and_add_special_tokens(servers):
    """vLLM 0.32's classification requests take ``messages`` (one conversation rendered
    with the chat template) and ``add_special_tokens`` (was: a 400 for each, unknown /
    unsupported). Oracles: transformers' probabilities of the hand-rendered conversation
    (the server's --chat-template) and of BERT's ids without [CLS] / [SEP]."""
    from transformers import AutoModelForSequenceClassification

    server, folder = servers["cls"]
    body = _post(server, "/classify", {"messages": [{"role": "user", "content": "paris"}]})
    assert body.status_code == 200, body.text
    rendered = "<user>paris\n"  # TINY_CHAT_TEMPLATE's rendering
    torch.testing.assert_close(torch.tensor(body.json()["data"][0]["probs"]),
                               torch.softmax(hf_logits(folder, [rendered])[0], -1),
                               atol=ATOL, rtol=0)
    tokens = len(_tokenizer(folder)(rendered)["input_ids"])
    assert body.json()["usage"]["prompt_tokens"] == tokens
    for extra, param in (({"input": "paris"}, "messages"), ({}, "input")):
        resp = _post(server, "/classify", {"messages": [{"role": "user", "content": "a"}],
                                           **extra} if extra else {})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = _post(server, "/classify", {"input": "paris", "add_generation_prompt": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "add_generation_prompt"
    server, folder = servers["ce"]
    text = "paris is the capital"
    plain = _tokenizer(folder)(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logit = model(input_ids=torch.tensor([plain])).logits[0]
    body = _post(server, "/classify", {"input": text, "add_special_tokens": False}).json()
    assert body["usage"]["prompt_tokens"] == len(plain)
    torch.testing.assert_close(torch.tensor(body["data"][0]["probs"]), torch.sigmoid(logit),
                               atol=ATOL, rtol=0)


def test_a_classify_server_with_many_labels_refuses_scores(servers):
    server, _ = servers["cls"]
    for path, body in (("/v1/score", {"text_1": "paris", "text_2": "city"}),
                       ("/rerank", {"query": "paris", "documents": ["city"]})):
        resp = _post(server, path, body)
        assert resp.status_code == 400
        assert resp.json()["error"] == {
            "message": "this server's model runs task='classify' (--task) with num_labels=3: "
                       "/v1/score and /v1/rerank need a one-label classifier (num_labels == 1, "
                       "a relevance logit); serve it with --task score for its 3 values per "
                       "pair, or use /v1/classify",
            "type": "invalid_request_error", "param": "model", "code": "wrong_task"}


def test_qwen3_reranker_from_hf_overrides_scores_reranks_and_classifies(servers):
    """The reranker recipe: a Qwen3ForCausalLM checkpoint, ``--hf-overrides`` turning it into
    Qwen3ForSequenceClassification from its "no" / "yes" LM-head rows, on a classify server;
    every route equals transformers' causal LM P(yes) at the last token."""
    server, folder = servers["rr"]
    tokenizer = _tokenizer(folder)
    ids = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    expected = hf_reranker_scores(folder, ids)
    assert expected.max() - expected.min() > 0.05  # the documents are told apart
    body = _post(server, "/v1/score", {"model": "rr", "text_1": QUERY,
                                       "text_2": DOCUMENTS}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected,
                               atol=ATOL, rtol=0)
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    body = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
    best = expected.argsort(descending=True).tolist()
    assert [r["index"] for r in body["results"]] == best[:2]
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]),
                               expected[best[:2]], atol=ATOL, rtol=0)
    body = _post(server, "/classify", {"input": ids[:2]}).json()
    torch.testing.assert_close(torch.tensor([d["probs"][0] for d in body["data"]]),
                               expected[:2], atol=ATOL, rtol=0)


def test_pooling_gives_a_classifiers_class_probabilities(servers):
    """/pooling (vLLM's generic endpoint) on a classify server: each input's ``data`` is its
    class probabilities (transformers' softmax), in base64 the float32 bytes; task, fields of
    embeddings and the per-token tasks are 400s naming them; a score server's /pooling
    classifies too (the sigmoid of its one logit)."""
    server, folder = servers["cls"]
    texts = [t for t in TEXTS if len(_tokenizer(folder)(t)["input_ids"]) <= 10][:3]
    expected = torch.softmax(hf_logits(folder, texts), dim=-1)
    for task in ({}, {"task": "classify"}):
        body = _post(server, "/pooling", {"model": "cls", "input": texts, "request_id": "p1",
                                          **task}).json()
        assert (body["id"], body["object"], body["model"]) == ("pool-p1", "list", "cls")
        assert [(d["index"], d["object"]) for d in body["data"]] == \
            [(i, "pooling") for i in range(len(texts))]
        torch.testing.assert_close(torch.tensor([d["data"] for d in body["data"]]), expected,
                                   atol=ATOL, rtol=0)
        tokens = sum(len(_tokenizer(folder)(t)["input_ids"]) for t in texts)
        assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0,
                                 "total_tokens": tokens}
    # another request: the same values up to a rerun's rounding (the torch kernels need not
    # repeat the bits: prefix-cache hits, other batch shapes); the base64 bytes' exactness
    # against the float reply is checked within one reply in test_openai_embeddings.py
    body = _post(server, "/pooling", {"input": texts, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["data"]), dtype=np.float32).tolist()
               for d in body["data"]]
    torch.testing.assert_close(torch.tensor(decoded), expected, atol=ATOL, rtol=0)
    classified = _post(server, "/classify", {"input": texts}).json()
    torch.testing.assert_close(torch.tensor([d["probs"] for d in classified["data"]]),
                               expected, atol=ATOL, rtol=0)
    for extra, param, code in (({"task": "embed"}, "task", "wrong_task"),
                               ({"task": "token_embed"}, "task", "wrong_task"),
                               ({"task": "score"}, "task", "unsupported_value"),
                               ({"task": "reward"}, "task", "invalid_value"),
                               ({"normalize": True}, "normalize", "invalid_value"),
                               ({"dimensions": 2}, "dimensions", "invalid_value"),
                               ({"messages": [{"role": "user", "content": "hi"}]}, "messages",
                                "invalid_value")):
        resp = _post(server, "/pooling", {"input": "paris", **extra})
        assert resp.status_code == 400, (extra, resp.text)
        assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)
    ce, _ = servers["ce"]
    body = _post(ce, "/pooling", {"input": "paris is the capital"}).json()
    probs = _post(ce, "/classify", {"input": "paris is the capital"}).json()["data"][0]["probs"]
    assert len(probs) == 1 and body["data"][0]["data"] == pytest.approx(probs, abs=ATOL)


def test_score_and_v2_rerank_aliases(servers):
    """vLLM's /score (= /v1/score) and /v2/rerank (= /v1/rerank): the same replies,
    transformers' causal-LM P(yes) on the reranker."""
    server, folder = servers["rr"]
    tokenizer = _tokenizer(folder)
    expected = hf_reranker_scores(folder, [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS])
    scores = {path: _post(server, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
              for path in ("/score", "/v1/score")}
    for path in ("/score", "/v1/score"):  # each within a rerun's rounding of the oracle
        torch.testing.assert_close(torch.tensor([d["score"] for d in scores[path]["data"]]),
                                   expected, atol=ATOL, rtol=0)
        assert [d["index"] for d in scores[path]["data"]] == list(range(len(DOCUMENTS)))
    reranks = {path: _post(server, path, {"query": QUERY, "documents": DOCUMENTS}).json()
               for path in ("/v2/rerank", "/v1/rerank")}
    for path in ("/v2/rerank", "/v1/rerank"):
        results = reranks[path]["results"]
        assert [r["index"] for r in results] == expected.argsort(descending=True).tolist()
        torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in results]),
                                   expected.sort(descending=True).values, atol=ATOL, rtol=0)


def _same_answer(routed: httpx.Response, direct: httpx.Response) -> None:
    """Two answers to one body equal but for the reply's id and time (values within float32
    rounding: a prompt's second run may reuse the first's cached KV)."""
    assert routed.status_code == direct.status_code == 200, routed.text
    got, want = routed.json(), direct.json()
    for body in (got, want):
        body.pop("id", None), body.pop("created", None)  # a score reply has no "created"
    assert _approx(got) == _approx(want)


def _approx(value):
    """``value`` with its floats rounded to 4 places (for comparing two JSON answers)."""
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_approx(v) for v in value]
    return round(value, 4) if isinstance(value, float) else value


def test_invocations_routes_by_the_served_task(servers):
    """SageMaker's /invocations: ``input`` or ``messages`` classifies on a classify server
    (it embeds nothing), ``text_1``/``text_2`` (vLLM 0.32: ``queries``/``documents``,
    ``data_1``/``data_2``) score and ``query``/``documents`` rerank on a score server,
    each answered as the endpoint's own route; a score body on a classifier with 3 labels
    (it serves no scores) names the one field it takes."""
    server, folder = servers["cls"]
    body = {"model": "cls", "input": [t for t in TEXTS
                                      if len(_tokenizer(folder)(t)["input_ids"]) <= 10][:2]}
    _same_answer(_post(server, "/invocations", body), _post(server, "/classify", body))
    refused = _post(server, "/invocations", {"text_1": "paris", "text_2": "city"})
    assert refused.status_code == 400
    assert "(input or messages for /v1/classify)" in refused.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": "paris"}]}  # vLLM 0.32's chat classify
    _same_answer(_post(server, "/invocations", body), _post(server, "/classify", body))
    server, _ = servers["ce"]
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[2:4]}),
                       ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS[2:4]}),
                       ("/v1/score", {"data_1": QUERY, "data_2": DOCUMENTS[2:4]}),
                       ("/rerank", {"query": QUERY, "documents": DOCUMENTS[2:4]}),
                       ("/classify", {"input": "paris is the capital"})):
        _same_answer(_post(server, "/invocations", body), _post(server, path, body))
