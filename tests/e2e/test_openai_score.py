"""/v1/score and /v1/rerank against sentence-transformers' CrossEncoder and transformers:
``kvflow serve`` with a tiny random BertForSequenceClassification (one label: sigmoid scores)
and XLMRobertaForSequenceClassification (two labels: the logits); an embedding server (the
session's ``bert_embed_server``) scoring by cosine similarity (against ``util.cos_sim``), and a
generating one (the session's ``smollm2_server``) that answers these routes with a 400
(``wrong_task``)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.e2e.conftest import bert_embed_model, ready_side_by_side
from tests.models.cross_encoder_models import (
    DOCUMENTS,
    QUERY,
    build_cross_encoder,
    hf_scores,
    st_scores,
)

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "64"]
BERT_ARGS = [*ARGS, "--served-model-name", "ce", "--max-model-len", "16"]
XLMR_ARGS = [*ARGS, "--served-model-name", "ce2"]
TOL = 2e-5


NAMES = ("bert", "xlmr")  # the cross-encoders


def _models(built_models) -> dict[str, str]:
    """{name: cross-encoder folder} for ``NAMES``."""
    return {"bert": built_models("ce_bert", lambda f: build_cross_encoder(f, "Bert", 1))[0],
            "xlmr": built_models("ce_xlmr",
                                 lambda f: build_cross_encoder(f, "XLMRoberta", 2))[0]}


def prestart_servers(fixture):
    """This module's servers (see ``prestart_servers`` in conftest.py)."""
    models = _models(fixture("built_models"))
    return [(models["xlmr"], XLMR_ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request, tiny_tokenizer, built_models):
    """{name: (server, folder)} for ``NAMES`` ("bert": the session's server of BERT_ARGS,
    ``start_server.shared`` with test_openai_classify.py), with "embed": (the session's
    ``bert_embed_server``, its SentenceTransformer) and "gen": (``smollm2_server``, None)."""
    models = _models(built_models)
    xlmr = start_server.declared(request, 0, wait=False)
    shared = {"bert": (start_server.shared(models["bert"], BERT_ARGS), models["bert"]),
              "embed": (request.getfixturevalue("bert_embed_server"),
                        bert_embed_model(tiny_tokenizer, built_models)[1]),
              "gen": (request.getfixturevalue("smollm2_server"), None)}
    with ready_side_by_side(xlmr):
        yield {"xlmr": (xlmr, models["xlmr"]), **shared}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _free_blocks(server) -> float:
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


def test_score_matches_cross_encoder(servers):
    server, folder = servers["bert"]
    docs = DOCUMENTS[2:4]  # pairs that fit --max-model-len 16
    body = _post(server, "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": docs}).json()
    pairs = [(QUERY, d) for d in docs]
    expected = st_scores(folder, pairs)
    torch.testing.assert_close(expected, hf_scores(folder, pairs), atol=TOL, rtol=1e-4)
    assert body["object"] == "list" and body["model"] == "ce" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected,
                               atol=TOL, rtol=1e-4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tokens = sum(len(tok(a, b)["input_ids"]) for a, b in pairs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # N-to-N, and a long pair cut by truncate_prompt_tokens
    body = _post(server, "/v1/score", {"text_1": docs, "text_2": docs[::-1],
                                       "request_id": "r1"}).json()
    assert body["id"] == "score-r1"
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               st_scores(folder, list(zip(docs, docs[::-1]))), atol=TOL,
                               rtol=1e-4)
    body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1],
                                       "truncate_prompt_tokens": 16}).json()
    assert body["usage"]["prompt_tokens"] == 16
    whole = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1],
                                        "truncate_prompt_tokens": -1}).json()  # max_model_len
    assert whole["usage"]["prompt_tokens"] == 16 and whole["data"] == body["data"]


@pytest.mark.parametrize("first, second", [("queries", "documents"), ("queries", "items"),
                                           ("data_1", "data_2")])
def test_vllm_032_score_fields(servers, first, second):
    """vLLM 0.32's /score bodies name the texts queries / documents, queries / items or
    data_1 / data_2 (was: a 400, unknown fields); the scores are CrossEncoder's, the pairs
    1-to-N and N-to-N as with text_1 / text_2; a field without its partner, or two pairs of
    fields at once, is a 400 naming the field; an embedding server scores them too."""
    server, folder = servers["bert"]
    docs = DOCUMENTS[2:4]  # pairs that fit --max-model-len 16
    body = _post(server, "/score", {first: QUERY, second: docs}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               st_scores(folder, [(QUERY, d) for d in docs]), atol=TOL,
                               rtol=1e-4)
    body = _post(server, "/v1/score", {first: docs, second: docs[::-1]}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               st_scores(folder, list(zip(docs, docs[::-1]))), atol=TOL,
                               rtol=1e-4)
    partner = {"queries": "documents", "data_1": "data_2"}[first]  # queries alone: documents
    for sent, param, code in (({first: QUERY}, partner, "missing_required_parameter"),
                              ({second: QUERY}, first, "missing_required_parameter"),
                              ({first: QUERY, second: "a", "text_1": "b", "text_2": "c"},
                               first, "invalid_value"),
                              ({}, "text_1", "missing_required_parameter")):
        resp = _post(server, "/v1/score", sent)
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)
    resp = _post(server, "/v1/score", {first: QUERY, second: DOCUMENTS[1]})  # 18 tokens
    assert resp.status_code == 400 and resp.json()["error"]["param"] == second
    assert resp.json()["error"]["message"].startswith(f"pair 0 ({first}, {second}) has 18")
    server, _ = servers["embed"]
    plain = _post(server, "/v1/score", {"text_1": QUERY, "text_2": docs}).json()["data"]
    assert _post(server, "/v1/score", {first: QUERY, second: docs}).json()["data"] == plain


def test_several_labels_score_as_lists_and_do_not_rerank(servers):
    server, folder = servers["xlmr"]
    body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    got = torch.tensor([d["score"] for d in body["data"]])
    assert got.shape == (len(DOCUMENTS), 2)
    torch.testing.assert_close(got, st_scores(folder, [(QUERY, d) for d in DOCUMENTS]),
                               atol=TOL, rtol=1e-4)
    resp = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": "rerank needs one relevance score per document, but this model has "
                   "num_labels=2: use /v1/score for its 2 values",
        "type": "invalid_request_error", "param": "model", "code": "invalid_value"}


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_orders_by_the_oracle(servers, path):
    server, folder = servers["bert"]
    docs = [DOCUMENTS[0], DOCUMENTS[2], DOCUMENTS[3], DOCUMENTS[5]]  # fit in 16 tokens
    expected = st_scores(folder, [(QUERY, d) for d in docs]).tolist()
    body = _post(server, path, {"model": "ce", "query": QUERY, "documents": docs,
                                "top_n": 3}).json()
    assert body["model"] == "ce" and body["id"].startswith("rerank-")
    results = body["results"]
    assert len(results) == 3
    for r in results:
        assert r["document"] == {"text": docs[r["index"]]}
        assert abs(r["relevance_score"] - expected[r["index"]]) < TOL
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    best = sorted(range(len(docs)), key=lambda i: -expected[i])
    # no near-ties among the oracle's top four, so its order is the one to expect
    assert all(expected[best[k]] - expected[best[k + 1]] > 10 * TOL for k in range(3))
    assert [r["index"] for r in results] == best[:3]
    # vLLM's usage: every pair's tokens as prompt_tokens and total_tokens (was total only)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in docs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    body = _post(server, path, {"query": QUERY, "documents": docs,
                                "return_documents": False}).json()
    assert len(body["results"]) == 4 and all("document" not in r for r in body["results"])
    # one document as a string, as vLLM takes it (was a 400: documents must be a list)
    body = _post(server, path, {"query": QUERY, "documents": docs[1]}).json()
    assert [(r["index"], r["document"]) for r in body["results"]] == [(0, {"text": docs[1]})]
    assert abs(body["results"][0]["relevance_score"] - expected[1]) < TOL
    tokens = len(tokenizer(QUERY, docs[1])["input_ids"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_errors_and_no_leaks(servers):
    server, _ = servers["bert"]
    idle = _free_blocks(server)
    long_doc = DOCUMENTS[1]  # 18 tokens with the query: more than --max-model-len 16
    cases = [
        ("/v1/score", {"text_1": QUERY, "text_2": [DOCUMENTS[2], long_doc]},
         {"message": "pair 1 (text_1, text_2) has 18 tokens but max_model_len is 16: shorten "
                     "it or send truncate_prompt_tokens",
          "type": "invalid_request_error", "param": "text_2",
          "code": "context_length_exceeded"}),
        ("/v1/rerank", {"query": QUERY, "documents": [DOCUMENTS[2], long_doc]},
         {"message": "documents[1] has 18 tokens but max_model_len is 16: shorten it or send "
                     "truncate_prompt_tokens",
          "type": "invalid_request_error", "param": "documents",
          "code": "context_length_exceeded"}),
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS},
         {"message": "text_1 has 2 texts and text_2 6: score one text_1 against N texts "
                     "(1-to-N) or two lists of the same length (N-to-N)",
          "type": "invalid_request_error", "param": "text_1", "code": "invalid_value"}),
        ("/v1/rerank", {"query": QUERY, "documents": []},
         {"message": "documents is an empty list: give at least one text",
          "type": "invalid_request_error", "param": "documents", "code": "invalid_value"}),
        ("/v1/score", {"text_1": QUERY, "text_2": "a", "top_k": 2},
         None),
    ]
    for path, body, error in cases:
        resp = _post(server, path, body)
        assert resp.status_code == 400, (path, body)
        if error is not None:
            assert resp.json()["error"] == error
        else:
            assert resp.json()["error"]["param"] == "top_k"
            assert resp.json()["error"]["code"] == "unknown_parameter"
    resp = _post(server, "/v1/score", {"text_1": "a", "text_2": "b", "model": "other"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert _post(server, "/v1/score", {"text_1": "a", "text_2": "b"}).status_code == 200
    assert _free_blocks(server) == idle > 0  # every block back after errors and a score


def _hf_score_of(folder: str, ids: list[int], types: list[int]) -> float:
    """transformers' sigmoid score of one already-tokenized pair (a one-label model)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits
    return torch.sigmoid(logits[0, 0]).item()


def test_truncation_side_cuts_the_whole_pair(servers):
    """vLLM's ``truncation_side`` on /v1/score and /v1/rerank: "left" keeps the last k of
    the pair's whole encoding, "right" the first k (special tokens and token types cut
    alike, as vLLM slices after encoding); oracle: transformers over those ids and types.
    Another value is a 400 naming it."""
    server, folder = servers["bert"]
    enc = AutoTokenizer.from_pretrained(folder)(QUERY, DOCUMENTS[1])
    ids, types = enc["input_ids"], enc["token_type_ids"]
    assert len(ids) == 18
    scores = {}
    for side, kept in (("left", slice(2, None)), ("right", slice(0, 16))):
        want = scores[side] = _hf_score_of(folder, ids[kept], types[kept])
        cut = {"truncate_prompt_tokens": 16, "truncation_side": side}
        body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1], **cut})
        assert body.json()["data"][0]["score"] == pytest.approx(want, abs=TOL)
        assert body.json()["usage"]["prompt_tokens"] == 16
        body = _post(server, "/v1/rerank", {"query": QUERY, "documents": [DOCUMENTS[1]], **cut})
        assert body.json()["results"][0]["relevance_score"] == pytest.approx(want, abs=TOL)
    assert abs(scores["left"] - scores["right"]) > 10 * TOL
    resp = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1],
                                       "truncate_prompt_tokens": 16, "truncation_side": "up"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncation_side"


def test_padding_max_length_pads_each_pair(servers):
    """vLLM 0.32's ``padding: "max_length"`` on /v1/score and /v1/rerank: each pair's ids are
    padded with [PAD] to --max-model-len 16, the pads taking the pair's last token type (1,
    its second segment), every pad attended (vLLM's encoder has no attention mask); oracle:
    transformers over those ids and types. Usage counts the pads; ``do_not_pad`` pads
    nothing. Was: a 400 (``unsupported_parameter``)."""
    server, folder = servers["bert"]
    tok = AutoTokenizer.from_pretrained(folder)
    docs = DOCUMENTS[2:4]
    want = []
    for doc in docs:
        enc = tok(QUERY, doc)
        ids, types = enc["input_ids"], enc["token_type_ids"]
        assert len(ids) < 16 and types[-1] == 1
        want.append(_hf_score_of(folder, ids + [tok.pad_token_id] * (16 - len(ids)),
                                 types + [1] * (16 - len(ids))))
    body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": docs,
                                       "padding": "max_length"})
    assert body.status_code == 200, body.text
    got = [d["score"] for d in body.json()["data"]]
    assert got == pytest.approx(want, abs=TOL)
    assert body.json()["usage"]["prompt_tokens"] == 32
    unpadded = hf_scores(folder, [(QUERY, d) for d in docs]).tolist()
    assert max(abs(a - b) for a, b in zip(got, unpadded)) > 10 * TOL  # the pads count
    body = _post(server, "/v1/rerank", {"query": QUERY, "documents": docs,
                                        "padding": "max_length"}).json()
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == \
        pytest.approx(dict(enumerate(want)), abs=TOL)
    body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": docs,
                                       "padding": "do_not_pad"}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(unpadded, abs=TOL)
    resp = _post(server, "/v1/score", {"text_1": "a", "text_2": "b", "padding": "longest"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "padding"


@pytest.mark.parametrize("path, body", [("/v1/score", {"text_1": "a", "text_2": "b"}),
                                        ("/v1/rerank", {"query": "a", "documents": ["b"]})])
def test_score_template_fields_are_refused(servers, path, body):
    """vLLM 0.32's ``chat_template_kwargs`` / ``instruction`` feed a score chat template,
    which this server does not render: a 400 naming each (was: ``unknown_parameter``, or
    ignored under --ignore-unknown-fields); null and ``{}`` ask for nothing and pass."""
    server, _ = servers["bert"]
    for field, value in (("chat_template_kwargs", {"instruction": "rank"}),
                         ("instruction", "rank by relevance")):
        resp = _post(server, path, {**body, field: value})
        error = resp.json()["error"]
        assert (resp.status_code, error["param"], error["code"]) == \
            (400, field, "unsupported_parameter"), resp.text
        assert "score chat template" in error["message"]
    resp = _post(server, path, {**body, "chat_template_kwargs": {}, "instruction": None})
    assert resp.status_code == 200, resp.text


def test_max_tokens_per_query_and_doc(servers):
    """vLLM 0.32's ``max_tokens_per_query`` / ``max_tokens_per_doc`` on /v1/score and
    /v1/rerank: each query / document is cut to its first N tokens (special tokens not
    counted) before the pair is tokenized, so a pair too long for --max-model-len 16 fits;
    oracle: transformers' score of the texts cut where the tokenizer's offsets put the N-th
    token's end. /v1/rerank echoes each document as sent. A limit not below the context is a
    400 naming it; so is vLLM's ``priority`` on a server without a priority policy (the
    embedding server runs one: taken there)."""
    server, folder = servers["bert"]
    tok = AutoTokenizer.from_pretrained(folder)

    def cut(text: str, n: int) -> str:
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return text[:offsets["offset_mapping"][n - 1][1]]

    limits = {"max_tokens_per_query": 3, "max_tokens_per_doc": 4}
    assert _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1]}) \
        .status_code == 400  # 18 tokens
    body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1],
                                       **limits}).json()
    query, doc = cut(QUERY, 3), cut(DOCUMENTS[1], 4)
    assert (query, doc) == ("what is the", "the quick brown fox")
    assert body["data"][0]["score"] == pytest.approx(float(hf_scores(folder, [(query, doc)])[0]),
                                                     abs=TOL)
    assert body["usage"]["prompt_tokens"] == len(tok(query, doc)["input_ids"]) == 10
    docs = DOCUMENTS[1:3]
    body = _post(server, "/v1/rerank", {"query": QUERY, "documents": docs,
                                        "max_tokens_per_doc": 4}).json()
    want = hf_scores(folder, [(QUERY, cut(d, 4)) for d in docs])
    got = {r["index"]: (r["relevance_score"], r["document"]["text"]) for r in body["results"]}
    assert {i: text for i, (_, text) in got.items()} == dict(enumerate(docs))
    torch.testing.assert_close(torch.tensor([got[i][0] for i in range(2)]), want, atol=TOL,
                               rtol=1e-4)
    for field, value, code in (("max_tokens_per_doc", 16, "invalid_value"),
                               ("max_tokens_per_query", -1, "integer_below_min_value"),
                               ("priority", 1, "unsupported_value")):
        resp = _post(server, "/v1/score", {"text_1": "a", "text_2": "b", field: value})
        error = resp.json()["error"]
        assert (resp.status_code, error["param"], error["code"]) == (400, field, code), resp.text
    embed, _ = servers["embed"]
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        assert _post(embed, path, {**body, "priority": -1}).status_code == 200


def test_an_embedding_server_scores_by_cosine_similarity(servers):
    from sentence_transformers import util

    server, st = servers["embed"]
    idle = _free_blocks(server)
    query, docs = "the quick brown fox", ["a lazy dog", "the quick brown fox jumps", "tokens"]
    expected = util.cos_sim(st.encode([query], convert_to_tensor=True),
                            st.encode(docs, convert_to_tensor=True))[0].float()
    body = _post(server, "/v1/score", {"text_1": query, "text_2": docs}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected,
                               atol=TOL, rtol=1e-4)
    tok = st.tokenizer
    tokens = sum(len(tok.encode(query)) + len(tok.encode(d)) for d in docs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    body = _post(server, "/v1/rerank", {"query": query, "documents": docs}).json()
    best = sorted(range(3), key=lambda i: -float(expected[i]))
    assert all(expected[best[k]] - expected[best[k + 1]] > 10 * TOL for k in range(2))
    assert [r["index"] for r in body["results"]] == best
    # truncate_prompt_tokens cuts each text as sentence-transformers cuts to max_seq_length
    whole, st.max_seq_length = st.max_seq_length, 4
    try:
        cut = util.cos_sim(st.encode([query], convert_to_tensor=True),
                           st.encode(docs, convert_to_tensor=True))[0].float()
    finally:
        st.max_seq_length = whole
    body = _post(server, "/v1/score", {"text_1": query, "text_2": docs,
                                       "truncate_prompt_tokens": 4}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), cut,
                               atol=TOL, rtol=1e-4)
    assert (cut - expected).abs().max() > 0.01
    cut_tokens = sum(4 + min(4, len(tok.encode(d))) for d in docs)
    assert body["usage"]["prompt_tokens"] == cut_tokens
    # truncation_side "left": each text's last 4 ids ([SEP] kept, [CLS] cut), as
    # /v1/embeddings cuts an input; oracle: sentence-transformers over those ids
    def st_vector(text: str) -> torch.Tensor:
        ids = tok.encode(text)[-4:]
        with torch.no_grad():
            return st({"input_ids": torch.tensor([ids]), "attention_mask":
                       torch.ones(1, len(ids), dtype=torch.long)})["sentence_embedding"][0]

    left = util.cos_sim(st_vector(query)[None], torch.stack([st_vector(d) for d in docs]))[0]
    body = _post(server, "/v1/score", {"text_1": query, "text_2": docs,
                                       "truncate_prompt_tokens": 4,
                                       "truncation_side": "left"}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               left.float(), atol=TOL, rtol=1e-4)
    assert (left.float() - cut).abs().max() > 0.01
    resp = _post(server, "/v1/score", {"text_1": "a", "text_2": "b",
                                       "truncate_prompt_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens"
    resp = _post(server, "/v1/score", {"text_1": "a", "text_2": " ".join(["fox"] * 200)})
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": "the text 'fox fox fox fox fox fox fox fox fox fox ' has 599 tokens but "
                   "max_model_len is 64", "type": "invalid_request_error", "param": "text_2",
        "code": "context_length_exceeded"}
    resp = _post(server, "/v1/rerank", {"query": " ".join(["fox"] * 200), "documents": ["a"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "query"
    assert _post(server, "/v1/score", {"text_1": "a", "text_2": "b"}).status_code == 200
    assert _free_blocks(server) == idle > 0


def test_a_generating_server_does_not_score(servers):
    server, _ = servers["gen"]
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        resp = _post(server, path, body)
        assert resp.status_code == 400
        assert resp.json()["error"] == {
            "message": "this server's model runs task='generate' (--task); this endpoint "
                       "needs task='score': use /v1/completions or /v1/chat/completions, or "
                       "start a server with --task score (a cross-encoder) or --runner "
                       "pooling --convert embed (an embedding model, cosine similarity)",
            "type": "invalid_request_error", "param": "model", "code": "wrong_task"}
    ce, _ = servers["bert"]
    resp = _post(ce, "/v1/embeddings", {"input": "a"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == (
        "this server's model runs task='score' (--task); this endpoint needs task='embed': "
        "use /v1/score, /v1/rerank or /v1/classify, or start a server with --runner pooling "
        "--convert embed (or --task embed)")
