"""``kvflow run-batch`` with /v1/score and /v1/rerank lines on a tiny random
BertForSequenceClassification, against sentence-transformers' CrossEncoder: the bodies
``kvflow serve`` would answer, in input order, a too-long pair's 400 included; and
/v1/classify lines on a tiny random Qwen2ForSequenceClassification against transformers. Each
runs in this process (``cli.main``: ``run_batch_here``), not a fresh interpreter."""

from __future__ import annotations

import json

import torch

from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder, st_scores

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "64",
        "--max-model-len", "16", "--served-model-name", "ce", "--no-progress"]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_score_and_rerank_lines_match_cross_encoder(built_models, tmp_path, run_batch_here):
    folder, _ = built_models("ce_bert", lambda f: build_cross_encoder(f, "Bert", 1))
    docs = [DOCUMENTS[0], DOCUMENTS[2], DOCUMENTS[3]]  # pairs that fit in 16 tokens
    lines = [_line("score", "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": docs}),
             _line("rerank", "/v1/rerank", {"query": QUERY, "documents": docs, "top_n": 2}),
             _line("long", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[1]}),
             # the server's other paths, which vLLM's run-batch takes too (invalid_url before)
             _line("alias-score", "/score", {"model": "ce", "text_1": QUERY, "text_2": docs}),
             _line("alias-rerank", "/v2/rerank", {"query": QUERY, "documents": docs,
                                                  "top_n": 2})]
    out = tmp_path / "out.jsonl"
    proc = run_batch_here(["-i", "-", "-o", str(out), "--model", folder, *ARGS],
                          "".join(line + "\n" for line in lines), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["score", "rerank", "long", "alias-score",
                                             "alias-rerank"]
    expected = st_scores(folder, [(QUERY, d) for d in docs])
    score = got[0]["response"]["body"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in score["data"]]), expected,
                               atol=2e-5, rtol=1e-4)
    best = sorted(range(3), key=lambda i: -float(expected[i]))
    assert float(expected[best[0]] - expected[best[1]]) > 1e-3
    assert float(expected[best[1]] - expected[best[2]]) > 1e-3
    results = got[1]["response"]["body"]["results"]
    assert [r["index"] for r in results] == best[:2]
    assert [r["document"]["text"] for r in results] == [docs[i] for i in best[:2]]
    long = got[2]["response"]
    assert long["status_code"] == 400
    assert long["body"]["error"]["code"] == "context_length_exceeded"
    assert long["body"]["error"]["message"].startswith("pair 0 (text_1, text_2) has 18 tokens")
    for alias, v1 in ((got[3], got[0]), (got[4], got[1])):
        assert alias["error"] is None and alias["response"]["status_code"] == 200, alias
        same = ("data", "usage") if alias is got[3] else ("results", "usage")
        assert {k: alias["response"]["body"][k] for k in same} == \
            {k: v1["response"]["body"][k] for k in same}


def test_classify_lines_match_transformers(built_models, tmp_path, run_batch_here):
    """/v1/classify lines on a tiny random Qwen2ForSequenceClassification (--task classify):
    the probabilities of transformers' logits -> softmax, an empty input's 400 in place."""
    from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits

    folder, _ = built_models("cls_qwen2_batch", lambda f: build_decoder_classifier(f, "Qwen2", 3))
    lines = [_line("many", "/v1/classify", {"model": "ce", "input": TEXTS[:3]}),
             _line("empty", "/v1/classify", {"input": ""}),
             _line("wrong", "/v1/completions", {"prompt": "paris", "max_tokens": 2})]
    out = tmp_path / "out.jsonl"
    args = [a for a in ARGS if a not in ("--max-model-len", "16")]
    proc = run_batch_here(["-i", "-", "-o", str(out), "--model", folder, "--task", "classify",
                           "--num-kv-blocks", "64", *args],
                          "".join(line + "\n" for line in lines), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["many", "empty", "wrong"]
    body = got[0]["response"]["body"]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]),
                               torch.softmax(hf_logits(folder, TEXTS[:3]), -1), atol=1e-5,
                               rtol=0)
    assert [d["label"] for d in body["data"]] == \
        [f"LABEL_{i}" for i in hf_logits(folder, TEXTS[:3]).argmax(-1).tolist()]
    empty = got[1]["response"]
    assert (empty["status_code"], empty["body"]["error"]["code"]) == (400, "empty_string")
    # the wrong-task 400 points at an endpoint this batch file takes: the one "many" used
    wrong = got[2]["response"]
    assert (wrong["status_code"], wrong["body"]["error"]["code"]) == (400, "wrong_task")
    assert wrong["body"]["error"]["message"].endswith(
        f"use {json.loads(lines[0])['url']}, or start a server with --runner generate (or "
        "--task generate)")
