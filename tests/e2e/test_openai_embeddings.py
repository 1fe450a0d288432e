"""/v1/embeddings and /pooling against sentence-transformers: ``kvflow serve`` with a tiny
random BERT (mean pooling) and a tiny random bare Llama decoder (last-token pooling,
Matryoshka, a chat template for /pooling's ``messages``), queried with the official openai
client (base64 by default) and plain JSON (float); vLLM's ``embed_dtype`` / ``endianness``
bytes against torch's own casts, ``encoding_format: bytes``."""

from __future__ import annotations

import base64
import json
import sys

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import TINY_CHAT_TEMPLATE
from tests.e2e.conftest import BERT_EMBED_ARGS, bert_embed_model, ready_side_by_side
from tests.models.embedding_models import build_decoder, st_embed

INPUTS = ["the quick brown fox", "a lazy dog while kvflow pages keys and values", "tokens"]
ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "4"]


DEC_ARGS = [*ARGS, "--num-kv-blocks", "64", "--served-model-name", "dec",
            "--max-num-batched-tokens", "8",  # in chunks
            "--chat-template", TINY_CHAT_TEMPLATE]


def _models(tiny_tokenizer, built_models) -> dict[str, tuple[str, object]]:
    """{"bert": (folder, SentenceTransformer), "decoder": (folder, SentenceTransformer)}, built
    once per session."""
    return {"bert": bert_embed_model(tiny_tokenizer, built_models),
            "decoder": built_models("decoder",
                                  lambda folder: build_decoder(tiny_tokenizer, folder,
                                                               "lasttoken"))}


def prestart_servers(fixture):
    """This module's servers, taken (the BERT one through the session's
    ``bert_embed_server``) and started ahead (``_prestart_next_module`` in conftest.py)."""
    models = _models(fixture("tiny_tokenizer"), fixture("built_models"))
    return [(models["bert"][0], BERT_EMBED_ARGS, None), (models["decoder"][0], DEC_ARGS, None)]


@pytest.fixture(scope="module")
def servers(start_server, request, tiny_tokenizer, built_models):
    """{"bert": (server, st), "decoder": (server, st)}: both servers come up side by side
    (every test here but one uses both); the BERT one is the session's ``bert_embed_server``
    (BERT_EMBED_ARGS, shared with test_openai_score.py), left running."""
    models = _models(tiny_tokenizer, built_models)
    bert_st, dec_st = models["bert"][1], models["decoder"][1]
    dec_server = start_server.declared(request, 1, wait=False)
    bert_server = request.getfixturevalue("bert_embed_server")  # ready (dec still starting)
    with ready_side_by_side(dec_server):
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


@pytest.mark.parametrize("which", ["bert", "decoder"])
def test_padding_max_length(which, bert, decoder):
    """vLLM 0.32's ``padding: "max_length"``: each prompt's ids padded with the tokenizer's
    pad token to --max-model-len and embedded whole, as vLLM does (no attention mask: mean
    pooling averages the pads, last-token pooling takes the last pad), usage counting the
    pads; oracle: sentence-transformers over the padded ids with every position attended.
    ``"do_not_pad"`` is no padding; /v1/score pads each text so too (the cosine similarity
    of the padded embeddings; was: a 400)."""
    server, st = bert if which == "bert" else decoder
    length = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    tok = st.tokenizer
    assert tok.pad_token_id is not None

    def padded_st(text: str) -> torch.Tensor:
        ids = tok.encode(text)
        ids = ids + [tok.pad_token_id] * (length - len(ids))
        with torch.no_grad():
            return st({"input_ids": torch.tensor([ids]), "attention_mask":
                       torch.ones(1, length, dtype=torch.long)})["sentence_embedding"][0]

    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        body = httpx.post(f"{server.url}{path}", timeout=60, json={
            "input": INPUTS[:2], "padding": "max_length"}).json()
        for d, text in zip(body["data"], INPUTS):
            _close(d[key], padded_st(text))
        assert body["usage"]["prompt_tokens"] == 2 * length
    plain = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={"input": INPUTS[0]})
    same = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={
        "input": INPUTS[0], "padding": "do_not_pad"})
    _close(same.json()["data"][0]["embedding"], torch.tensor(plain.json()["data"][0]["embedding"]))
    assert (padded_st(INPUTS[0]) - torch.tensor(plain.json()["data"][0]["embedding"])) \
        .abs().max() > 1e-3
    resp = httpx.post(f"{server.url}/v1/score", timeout=60, json={
        "text_1": INPUTS[0], "text_2": INPUTS[1], "padding": "max_length"})
    assert resp.status_code == 200, resp.text
    want = torch.nn.functional.cosine_similarity(padded_st(INPUTS[0]), padded_st(INPUTS[1]),
                                                 dim=0)
    assert resp.json()["data"][0]["score"] == pytest.approx(want.item(), abs=1e-5)
    assert resp.json()["usage"]["prompt_tokens"] == 2 * length


def test_add_special_tokens_embed_dtype_and_endianness_refusals(bert, decoder):
    """A non-bool ``add_special_tokens`` is a 400 naming it (what false does is checked with a
    tokenizer that adds ``<bos>``: tests/e2e/test_openai_fields.py); so are an unknown
    ``embed_dtype`` or ``endianness``, either set with ``encoding_format`` float (which
    writes no bytes), and a ``priority`` on a server not run by priority."""
    server, _ = bert
    for extra, param, code in (({"add_special_tokens": "no"}, "add_special_tokens",
                                "invalid_type"),
                               ({"embed_dtype": "int8", "encoding_format": "base64"},
                                "embed_dtype", "invalid_value"),
                               ({"endianness": "middle", "encoding_format": "bytes"},
                                "endianness", "invalid_value"),
                               ({"encoding_format": "float16"}, "encoding_format",
                                "invalid_value"),
                               ({"embed_dtype": "float16"}, "embed_dtype", "invalid_value"),
                               ({"endianness": "big", "encoding_format": "float"},
                                "endianness", "invalid_value")):
        for path in ("/v1/embeddings", "/pooling"):
            resp = httpx.post(f"{server.url}{path}", json={"input": "a", **extra})
            assert resp.status_code == 400, (path, extra, resp.text)
            assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
                (param, code), (path, resp.json())
    for path in ("/v1/embeddings", "/pooling"):  # the decoder runs fcfs; BERT priority
        resp = httpx.post(f"{decoder[0].url}{path}", json={"input": "a", "priority": 1})
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, "priority")
        assert httpx.post(f"{server.url}{path}", timeout=60,
                          json={"input": "a", "priority": 1}).status_code == 200


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _decoded(raw: bytes, dtype: torch.dtype, endianness: str) -> torch.Tensor:
    """``raw`` read back as a client would: numpy for the bytes (swapped from big-endian),
    then viewed as ``dtype`` by torch."""
    size = torch.tensor([], dtype=dtype).element_size()
    values = np.frombuffer(raw, dtype=np.uint8).reshape(-1, size)
    if endianness == "big" or (endianness == "native" and sys.byteorder == "big"):
        values = values[:, ::-1]
    return torch.from_numpy(values.copy()).flatten().view(dtype)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_embed_dtype_and_endianness(bert, path):
    """vLLM's ``embed_dtype`` / ``endianness`` with base64: the bytes decode to torch's own
    cast of the float32 vector (``encoding_format`` float's numbers), bit for bit, in every
    dtype and byte order; float32 is the float reply itself; the openai client's default
    (base64, no embed_dtype) is little-endian float32 as before."""
    server, st = bert
    key = "embedding" if path == "/v1/embeddings" else "data"
    floats = [d[key] for d in httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS, "encoding_format": "float"}).json()["data"]]
    for got, ref in zip(floats, st_embed(st, INPUTS)):
        _close(got, ref)
    for name, dtype in DTYPES.items():
        for endianness in ("native", "big", "little"):
            body = httpx.post(f"{server.url}{path}", timeout=60, json={
                "input": INPUTS, "encoding_format": "base64", "embed_dtype": name,
                "endianness": endianness}).json()
            for d, vector in zip(body["data"], floats):
                got = _decoded(base64.b64decode(d[key]), dtype, endianness)
                want = torch.tensor(vector, dtype=torch.float32).to(dtype)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    (name, endianness)
                if name == "float32":
                    assert got.tolist() == vector
    one = httpx.post(f"{server.url}{path}", timeout=60, json={  # the same batch shape
        "input": INPUTS[0], "encoding_format": "float"}).json()["data"][0][key]
    body = httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS[0], "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(body["data"][0][key]), "<f4").tolist() == one


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_bytes_encoding(bert, path, tiny_tokenizer):
    """vLLM's ``encoding_format: bytes``: the body is every input's bytes in input order
    (application/octet-stream), the ``metadata`` header their offsets, shape, dtype and the
    usage; each slice decodes to torch's cast of the float reply. vLLM 0.32's
    ``bytes_only``: the same body without the header."""
    server, _ = bert
    key = "embedding" if path == "/v1/embeddings" else "data"
    floats = [d[key] for d in httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS}).json()["data"]]
    resp = httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS, "encoding_format": "bytes", "embed_dtype": "bfloat16",
        "endianness": "big", "request_id": "b1"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/octet-stream"
    meta = json.loads(resp.headers["metadata"])
    assert meta["id"] == ("embd-b1" if path == "/v1/embeddings" else "pool-b1")
    tokens = sum(len(tiny_tokenizer.encode(s)) for s in INPUTS)
    assert meta["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    dim = len(floats[0])
    assert [(m["index"], m["start"], m["end"], m["shape"], m["embed_dtype"], m["endianness"])
            for m in meta["data"]] == [(i, 2 * dim * i, 2 * dim * (i + 1), [dim], "bfloat16",
                                        "big") for i in range(len(INPUTS))]
    assert len(resp.content) == 2 * dim * len(INPUTS)
    for m, vector in zip(meta["data"], floats):
        got = _decoded(resp.content[m["start"]:m["end"]], torch.bfloat16, "big")
        want = torch.tensor(vector).to(torch.bfloat16)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # vLLM 0.32's bytes_only: the same body, no metadata header
    only = httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS, "encoding_format": "bytes_only", "embed_dtype": "bfloat16",
        "endianness": "big"})
    assert only.status_code == 200, only.text
    assert only.headers["content-type"] == "application/octet-stream"
    assert "metadata" not in only.headers
    assert only.content == resp.content
    little = httpx.post(f"{server.url}{path}", timeout=60, json={
        "input": INPUTS, "encoding_format": "bytes_only", "endianness": "little"}).content
    assert np.frombuffer(little, "<f4").reshape(len(INPUTS), dim).tolist() == floats


def test_pooling_embeds_inputs(bert, decoder):
    """/pooling on an embedding server: each input's ``data`` is its embedding, the same
    values as /v1/embeddings (sentence-transformers' vectors), with its ``dimensions`` and
    ``normalize``; vLLM's reply shape; a classify task is a 400 naming ``task``."""
    server, st = decoder
    body = httpx.post(f"{server.url}/pooling", timeout=60, json={
        "model": "dec", "input": INPUTS, "request_id": "q"}).json()
    assert (body["id"], body["object"], body["model"]) == ("pool-q", "list", "dec")
    assert [(d["index"], d["object"]) for d in body["data"]] == \
        [(i, "pooling") for i in range(len(INPUTS))]
    for d, ref in zip(body["data"], st_embed(st, INPUTS)):
        _close(d["data"], ref)
    embedded = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={
        "input": INPUTS}).json()
    for d, e in zip(body["data"], embedded["data"]):  # another request: a rerun's rounding
        _close(d["data"], torch.tensor(e["embedding"]))  # (prefix-cache hits, batch shapes)
    assert body["usage"] == {**embedded["usage"], "completion_tokens": 0}
    raw = st_embed(_raw_st(st), INPUTS[:1])[0]
    for extra, expected in (({"dimensions": 8},
                             torch.nn.functional.normalize(st_embed(st, INPUTS[:1])[0][:8],
                                                           dim=0)),
                            ({"normalize": False, "task": "embed"}, raw)):
        body = httpx.post(f"{server.url}/pooling", timeout=60, json={
            "input": INPUTS[0], **extra}).json()
        _close(body["data"][0]["data"], expected)
    for extra, param in (({"task": "classify"}, "task"), ({}, "input"),
                         ({"input": "a", "chat_template_kwargs": {"x": 1}},
                          "chat_template_kwargs")):
        resp = httpx.post(f"{server.url}/pooling", json=extra)
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text
    for endpoint in ("/pooling", "/v1/embeddings"):
        resp = httpx.post(f"{bert[0].url}{endpoint}",
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "no_chat_template")


def _vector(body: dict) -> list[float]:
    """The first vector of a /pooling or /v1/embeddings reply."""
    first = body["data"][0]
    return first["data"] if "data" in first else first["embedding"]


@pytest.mark.parametrize("endpoint", ["/pooling", "/v1/embeddings", "/invocations"])
def test_pooling_messages(decoder, tiny_tokenizer, endpoint):
    """``messages`` on /pooling and (vLLM's chat-style embedding request) /v1/embeddings, and
    /invocations routing them there on an embedding server: the conversation rendered by the
    server's chat template (``--chat-template``, as /v1/chat/completions renders it; no
    generation prompt unless asked) is embedded as that text would be (sentence-transformers'
    vector of the rendered text, rendered here by hand); ``truncate_prompt_tokens`` keeps the
    rendered text's first tokens; both ``input`` and ``messages``, or a chat field with
    ``input``, is a 400 naming the field."""
    server, st = decoder
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "the quick brown fox"}]
    text = "<system>be brief\n<user>the quick brown fox\n"
    assert tiny_tokenizer.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)
    for extra, rendered in (({}, text),
                            ({"add_generation_prompt": True}, text + "<assistant>")):
        body = httpx.post(f"{server.url}{endpoint}", timeout=60, json={
            "messages": messages, "encoding_format": "float", **extra}).json()
        _close(_vector(body), st_embed(st, [rendered])[0])
        n = len(tiny_tokenizer.encode(rendered))
        assert body["usage"]["prompt_tokens"] == n
    ids = tiny_tokenizer.encode(text)
    body = httpx.post(f"{server.url}{endpoint}", timeout=60, json={
        "messages": messages, "truncate_prompt_tokens": 5, "encoding_format": "float"}).json()
    same = httpx.post(f"{server.url}/pooling", timeout=60, json={"input": ids[:5]}).json()
    _close(_vector(body), torch.tensor(same["data"][0]["data"]))
    assert body["usage"]["prompt_tokens"] == 5
    for extra, param in (({"input": "a", "messages": messages}, "messages"),
                         ({"input": "a", "add_generation_prompt": True},
                          "add_generation_prompt")):
        resp = httpx.post(f"{server.url}{endpoint}", json=extra, timeout=60)
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text


def test_embeddings_batch_chat_requests(decoder, tiny_tokenizer):
    """vLLM 0.32's batch chat embedding requests on /v1/embeddings: ``messages`` as a list of
    conversations, and chat messages (one conversation or a list of them) in ``input``: each
    conversation rendered by the chat template and embedded as that text (sentence-
    transformers' vector), in order, usage summing their tokens; errors name the
    conversation where it was sent (``messages.<b>``, ``input...``); /pooling, as vLLM's,
    takes one conversation only."""
    server, st = decoder
    first = [{"role": "user", "content": "the quick brown fox"}]
    second = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tokens"}]
    texts = ["<user>the quick brown fox\n", "<system>be brief\n<user>tokens\n"]
    tokens = sum(len(tiny_tokenizer.encode(t)) for t in texts)
    for body in ({"messages": [first, second]}, {"input": [first, second]}):
        reply = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json=body).json()
        assert [d["index"] for d in reply["data"]] == [0, 1], reply
        for d, ref in zip(reply["data"], st_embed(st, texts)):
            _close(d["embedding"], ref)
        assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    reply = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={"input": second}).json()
    _close(reply["data"][0]["embedding"], st_embed(st, texts[1:])[0])
    long = [{"role": "user", "content": "word " * 60}]
    for body, param, code in (
            ({"messages": [first, []]}, "messages.1", "empty_array"),
            ({"messages": [first, [{"role": "user"}]]}, "messages.1.0.content",
             "missing_required_parameter"),
            ({"input": [{"role": "bogus", "content": "x"}]}, "input.0.role", "invalid_value"),
            ({"input": [{"role": "user"}]}, "input.0.content", "missing_required_parameter"),
            ({"input": [first, long]}, "input.1", "context_length_exceeded"),
            ({"messages": long}, "messages", "context_length_exceeded")):
        resp = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json=body)
        error = resp.json()["error"]
        assert (resp.status_code, error["param"], error["code"]) == (400, param, code), \
            (body, resp.text)
    resp = httpx.post(f"{server.url}/pooling", timeout=60, json={"messages": [first, second]})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "messages.0"), resp.text


def test_invocations_embeds_and_scores(bert):
    """SageMaker's /invocations on an embedding server: ``input`` embeds (equal to
    /v1/embeddings' answer and to sentence-transformers), ``text_1``/``text_2`` score as
    /v1/score does; a body with none of the endpoints' fields is a 400 listing the fields it
    could have had."""
    server, st = bert
    body = {"input": INPUTS, "encoding_format": "float"}
    routed = httpx.post(f"{server.url}/invocations", json=body, timeout=60).json()
    direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    for reply in (routed, direct):
        reply.pop("id", None), reply.pop("created", None)
    assert routed == direct
    for d, ref in zip(routed["data"], st_embed(st, INPUTS)):
        _close(d["embedding"], ref)
    body = {"text_1": INPUTS[0], "text_2": INPUTS[1:]}
    routed = httpx.post(f"{server.url}/invocations", json=body, timeout=60).json()
    direct = httpx.post(f"{server.url}/v1/score", json=body, timeout=60).json()
    assert [d["score"] for d in routed["data"]] == [d["score"] for d in direct["data"]]
    refused = httpx.post(f"{server.url}/invocations", timeout=60, json={"text": "hi"})
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "input or messages for /v1/embeddings" in message, message
    assert "text_1 or text_2 or queries or items or data_1 or data_2 for /v1/score" in message, \
        message
