"""/v1/embeddings against sentence-transformers: ``kvflow serve`` with a tiny random BERT
(mean pooling) and a tiny random bare Llama decoder (last-token pooling, Matryoshka), queried
with the official openai client (base64 by default) and plain JSON (float)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.e2e.conftest import ready_side_by_side
from tests.models.embedding_models import build_bert, build_decoder, st_embed

INPUTS = ["the quick brown fox", "a lazy dog while kvflow pages keys and values", "tokens"]
ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "4"]


# whole prompts per step, and no KV cache to size (an encoder refuses --num-kv-blocks)
BERT_ARGS = [*ARGS, "--served-model-name", "bert", "--max-num-batched-tokens", "64"]
DEC_ARGS = [*ARGS, "--num-kv-blocks", "64", "--served-model-name", "dec",
            "--max-num-batched-tokens", "8"]  # in chunks


def _models(tiny_tokenizer, built_models) -> dict[str, tuple[str, object]]:
    """{"bert": (folder, SentenceTransformer), "decoder": (folder, SentenceTransformer)}, built
    once per session."""
    return {"bert": built_models("bert",
                               lambda folder: build_bert(tiny_tokenizer, folder, "mean")),
            "decoder": built_models("decoder",
                                  lambda folder: build_decoder(tiny_tokenizer, folder,
                                                               "lasttoken"))}


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    models = _models(fixture("tiny_tokenizer"), fixture("built_models"))
    return [(models["bert"][0], BERT_ARGS, None), (models["decoder"][0], DEC_ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request, tiny_tokenizer, built_models):
    """{"bert": (server, st), "decoder": (server, st)}: both servers come up side by side
    (every test here but one uses both)."""
    models = _models(tiny_tokenizer, built_models)
    bert_st, dec_st = models["bert"][1], models["decoder"][1]
    bert_server = start_server.declared(request, 0, wait=False)
    dec_server = start_server.declared(request, 1, wait=False)
    with ready_side_by_side(bert_server, dec_server):
        yield {"bert": (bert_server, bert_st), "decoder": (dec_server, dec_st)}


@pytest.fixture(scope="module")
def bert(servers):
    return servers["bert"]


@pytest.fixture(scope="module")
def decoder(servers):
    return servers["decoder"]


def _close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["bert", "decoder"])
def test_embeddings_match_sentence_transformers(which, bert, decoder, tiny_tokenizer):
    server, st = bert if which == "bert" else decoder
    expected = st_embed(st, INPUTS)
    reply = server.client().embeddings.create(model="bert" if which == "bert" else "dec",
                                              input=INPUTS)  # the client asks for base64
    assert [d.index for d in reply.data] == [0, 1, 2]
    for d, ref in zip(reply.data, expected):
        _close(d.embedding, ref)
    assert reply.usage.prompt_tokens == sum(len(tiny_tokenizer.encode(s)) for s in INPUTS)
    ids = tiny_tokenizer.encode(INPUTS[1])
    body = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                      json={"input": ids, "encoding_format": "float"}).json()
    _close(body["data"][0]["embedding"], expected[1])


def test_dimensions(decoder, bert):
    server, st = decoder
    full = st_embed(st, INPUTS[:1])[0]
    body = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                      json={"input": INPUTS[0], "dimensions": 8}).json()
    _close(body["data"][0]["embedding"], torch.nn.functional.normalize(full[:8], dim=0))
    resp = httpx.post(f"{bert[0].url}/v1/embeddings", json={"input": "a", "dimensions": 8})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "dimensions"


def test_wrong_endpoint_and_bad_input(bert, start_server, tiny_llama):
    server, _ = bert
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "wrong_task"
    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": ["a", ""]}, "input.1"), ({"input": [[5], []]}, "input.1"),
                        ({"input": [10**6]}, "input.0"),
                        ({"input": "a", "model": "x"}, "model"),
                        ({"input": "a", "target_ttft_ms": 50}, "target_ttft_ms"),
                        ({"input": "a", "target_tpot_ms": 50}, "target_tpot_ms")):
        resp = httpx.post(f"{server.url}/v1/embeddings", json=body)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, body
    too_long = " ".join(["fox"] * 200)
    resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": too_long})
    assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]["message"]
    assert server.metrics() is not None  # still serving
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a"})
    assert ok.status_code == 200


@pytest.mark.parametrize("which", ["bert", "decoder"])
@pytest.mark.parametrize("make_input,where,bad", [
    (lambda v: [5, 6, v, -1], "input.2", "V"),  # one list of ids: the id's index
    (lambda v: [[5, 6], [8], [7, -1, v]], "input.2.1", -1),  # the input's, then the id's
])
def test_out_of_vocabulary_names_the_index(which, bert, decoder, make_input, where, bad):
    """A token id outside the model's vocabulary (its config's ``vocab_size``, read from the
    sentence-transformers model) is named by its path, in the words /v1/completions uses for
    ``prompt.N`` / ``prompt.I.N``: it was ``input`` (one list) without the id's index, in
    the engine's words. The first bad id in request order is named ("V": the vocabulary
    size)."""
    server, st = bert if which == "bert" else decoder
    vocab = st[0].auto_model.config.vocab_size
    bad = vocab if bad == "V" else bad
    resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": make_input(vocab)})
    assert (resp.status_code, resp.json()) == (400, {"error": {
        "message": f"{where}: token id {bad} is outside the vocabulary [0, {vocab})",
        "type": "invalid_request_error", "param": where, "code": "invalid_value"}})


def _raw_st(st):
    """``st`` less its ``Normalize`` module (the oracle of ``normalize: false``)."""
    from sentence_transformers import SentenceTransformer, models

    assert isinstance(st[-1], models.Normalize)
    return SentenceTransformer(modules=list(st)[:-1], device="cpu")


@pytest.mark.parametrize("which", ["bert", "decoder"])
def test_normalize(which, bert, decoder):
    """vLLM's ``normalize``: false returns sentence-transformers' pooled vector without its
    Normalize module (mean pooling for BERT, last token for the decoder; with
    ``dimensions`` cut, not normalized again), true the normalized one; a non-bool is a 400
    naming it."""
    server, st = bert if which == "bert" else decoder
    raw = st_embed(_raw_st(st), INPUTS)
    assert all(abs(v.norm().item() - 1.0) > 1e-2 for v in raw)
    for body, expected in (({"normalize": False}, raw),
                           ({"normalize": True}, st_embed(st, INPUTS)),
                           *([({"normalize": False, "dimensions": 8}, [v[:8] for v in raw])]
                             if which == "decoder" else [])):
        reply = server.client().embeddings.create(model="bert" if which == "bert" else "dec",
                                                  input=INPUTS, extra_body=body)
        for d, ref in zip(reply.data, expected):
            _close(d.embedding, ref)
    resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a", "normalize": "no"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "normalize", resp.text


def test_add_special_tokens_and_embed_dtype_refusals(bert):
    """A non-bool ``add_special_tokens`` is a 400 naming it (what false does is checked with a
    tokenizer that adds ``<bos>``: tests/e2e/test_openai_fields.py); ``embed_dtype`` stays
    refused: vLLM pairs it with an ``endianness`` and fp8 formats kvflow does not encode."""
    server, _ = bert
    for field, value, code in (("add_special_tokens", "no", "invalid_type"),
                               ("embed_dtype", "float16", "unsupported_parameter")):
        resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a", field: value})
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (field, code)
