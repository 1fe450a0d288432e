"""vLLM 0.32's ``LLM.score(data_1, data_2, *, use_tqdm, pooling_params, lora_request,
tokenization_kwargs, chat_template)`` on a tiny random BERT cross-encoder (one label), against
transformers' ``AutoModelForSequenceClassification`` (logit through a sigmoid) on the token ids
the HF tokenizer gives:

- ``tokenization_kwargs`` cut each pair as the tokenizer's ``longest_first`` truncation
  (``truncate_prompt_tokens`` or ``truncation`` + ``max_length``), or the whole encoding's last
  tokens with ``truncation_side="left"``;
- ``chat_template`` renders ``query`` / ``document`` messages (the text written out here by
  hand), tokenized as one sequence;
- vLLM 0.32's ``PoolingParams(extra_kwargs=...)``: ``max_tokens_per_query`` /
  ``max_tokens_per_doc`` cut each text to its first N tokens (where the tokenizer's offsets
  put the N-th token's end, as /v1/score cuts) before the pair is tokenized, and
  ``chat_template_kwargs`` are the template's variables;
- keys a pair cannot take, a cut given twice and a template that fails are refused."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder, hf_scores

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ce_bert"))
    build_cross_encoder(path, "Bert", 1)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)


def hf_score_of(folder: str, encoding) -> float:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(**{k: torch.tensor([v]) for k, v in encoding.items()}).logits[0]
    return float(torch.sigmoid(logits)[0])


def scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


def test_the_vllm_keywords(llm, folder):
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False, pooling_params=None, lora_request=None,
                     tokenization_kwargs=None, chat_template=None)
    torch.testing.assert_close(scores(outs), hf_scores(folder, [(QUERY, d) for d in DOCUMENTS]),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [{"truncate_prompt_tokens": 9},
                                    {"truncation": True, "max_length": 9}])
def test_tokenization_kwargs_cut_the_pair(llm, folder, kwargs):
    tokenizer = llm.get_tokenizer()
    doc = DOCUMENTS[1]
    enc = tokenizer(QUERY, doc, truncation="longest_first", max_length=9)
    assert len(tokenizer(QUERY, doc)["input_ids"]) > 9  # the cut is real
    (out,) = llm.score(QUERY, doc, use_tqdm=False, tokenization_kwargs=kwargs)
    assert out.prompt_token_ids == enc["input_ids"]
    assert out.outputs.score == pytest.approx(hf_score_of(folder, enc), abs=2e-5)
    (arg,) = llm.score(QUERY, doc, 9, use_tqdm=False)
    assert arg.prompt_token_ids == out.prompt_token_ids


def test_truncation_side_left_keeps_the_last_tokens(llm, folder):
    tokenizer = llm.get_tokenizer()
    full = tokenizer(QUERY, DOCUMENTS[1])
    enc = {k: v[-7:] for k, v in full.items()}
    (out,) = llm.score(QUERY, DOCUMENTS[1], use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 7,
                                            "truncation_side": "left"})
    assert out.prompt_token_ids == enc["input_ids"]
    assert out.outputs.score == pytest.approx(hf_score_of(folder, enc), abs=2e-5)


def test_chat_template_renders_query_and_document(llm, folder):
    tokenizer = llm.get_tokenizer()
    outs = llm.score(QUERY, DOCUMENTS[:2], use_tqdm=False, chat_template=TEMPLATE)
    for out, doc in zip(outs, DOCUMENTS[:2]):
        enc = tokenizer(f"query: {QUERY}\ndocument: {doc}\n")
        assert out.prompt_token_ids == enc["input_ids"]
        assert out.outputs.score == pytest.approx(hf_score_of(folder, enc), abs=2e-5)
    plain = llm.score(QUERY, DOCUMENTS[:2], use_tqdm=False)
    assert [o.prompt_token_ids for o in plain] != [o.prompt_token_ids for o in outs]
    (cut,) = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False, chat_template=TEMPLATE,
                       tokenization_kwargs={"truncate_prompt_tokens": 6})
    assert cut.prompt_token_ids == tokenizer(f"query: {QUERY}\ndocument: {DOCUMENTS[0]}\n",
                                             truncation=True, max_length=6)["input_ids"]


@pytest.mark.parametrize("kwargs, match", [
    ({"tokenization_kwargs": {"do_lower_case": True}}, r"\['do_lower_case'\]"),
    ({"tokenization_kwargs": {"add_special_tokens": False}}, "add_special_tokens=False"),
    ({"tokenization_kwargs": {"padding": "max_length"}}, r"\['padding'\]"),
    ({"tokenization_kwargs": {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens": 5},
     "given twice"),
    ({"tokenization_kwargs": {"stride": 2}}, "stride"),
    ({"chat_template": "{{ messages[0]['nope'] + 1 }}"}, "chat_template cannot render"),
])
def test_refusals_name_the_key(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def _cut(tokenizer, text: str, n: int) -> str:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text[:offsets["offset_mapping"][n - 1][1]]


def test_extra_kwargs_max_tokens_per_query_and_doc(llm, folder):
    """Was: ``PoolingParams`` took no ``extra_kwargs`` (a TypeError)."""
    tokenizer = llm.get_tokenizer()
    params = PoolingParams(extra_kwargs={"max_tokens_per_query": 3, "max_tokens_per_doc": 4})
    outs = llm.score(QUERY, DOCUMENTS[:3], use_tqdm=False, pooling_params=params)
    query = _cut(tokenizer, QUERY, 3)
    docs = [_cut(tokenizer, d, 4) for d in DOCUMENTS[:3]]
    assert query == "what is the" and docs[1] == "the quick brown fox"
    for out, doc in zip(outs, docs):
        assert out.prompt_token_ids == tokenizer(query, doc)["input_ids"]
    torch.testing.assert_close(scores(outs), hf_scores(folder, [(query, d) for d in docs]),
                               atol=2e-5, rtol=1e-4)
    only_doc = PoolingParams(extra_kwargs={"max_tokens_per_query": 0, "max_tokens_per_doc": 4})
    (out,) = llm.score(QUERY, DOCUMENTS[1], use_tqdm=False, pooling_params=only_doc)
    assert out.prompt_token_ids == tokenizer(QUERY, docs[1])["input_ids"]
    assert params.extra_kwargs == {"max_tokens_per_query": 3, "max_tokens_per_doc": 4}


def test_extra_kwargs_chat_template_kwargs(llm, folder):
    tokenizer = llm.get_tokenizer()
    template = "{{ instruction }}\n" + TEMPLATE
    params = PoolingParams(extra_kwargs={"chat_template_kwargs": {"instruction": "rank it"}})
    (out,) = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False, chat_template=template,
                       pooling_params=params)
    enc = tokenizer(f"rank it\nquery: {QUERY}\ndocument: {DOCUMENTS[0]}\n")
    assert out.prompt_token_ids == enc["input_ids"]
    assert out.outputs.score == pytest.approx(hf_score_of(folder, enc), abs=2e-5)


@pytest.mark.parametrize("extra, match", [
    ({"max_tokens_per_query": 3, "instruction": "x"}, r"not \['instruction'\]"),
    ({"max_tokens_per_doc": 64}, r"max_tokens_per_doc=64 must be an integer in \[0, "),
    ({"max_tokens_per_query": -1}, "max_tokens_per_query=-1"),
    ({"chat_template_kwargs": {"instruction": "x"}}, "give LLM.score\\(chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, r"sets \['tokenize'\]"),
])
def test_extra_kwargs_refusals(llm, extra, match):
    with pytest.raises(ValueError, match=match):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False, pooling_params=PoolingParams(
            extra_kwargs=extra), chat_template=TEMPLATE if "tokenize" in str(extra) else None)
    assert not llm.engine.has_unfinished_requests()


def test_extra_kwargs_elsewhere_are_refused(llm):
    with pytest.raises(ValueError, match="only LLM.score reads it"):
        llm.classify("a cat", use_tqdm=False, pooling_params=PoolingParams(
            task="classify", extra_kwargs={"max_tokens_per_doc": 2}))


def test_extra_kwargs_cut_an_embedding_models_texts(tiny_tokenizer, tmp_path):
    """On an embedding model each text is cut, then embedded: the score is the cosine
    similarity of sentence-transformers' embeddings of the cut texts."""
    from tests.models.embedding_models import build_bert

    st = build_bert(tiny_tokenizer, str(tmp_path / "st"), "mean")
    llm = LLM(model=str(tmp_path / "st"), dtype="float32", device="cpu",
              max_num_batched_tokens=64)
    tokenizer = llm.get_tokenizer()
    query, doc = "the quick brown fox jumps", "a lazy dog sleeps in the sun all day"
    params = PoolingParams(extra_kwargs={"max_tokens_per_query": 2, "max_tokens_per_doc": 3})
    (out,) = llm.score(query, doc, use_tqdm=False, pooling_params=params)
    q, d = _cut(tokenizer, query, 2), _cut(tokenizer, doc, 3)
    assert len(q) < len(query) and len(d) < len(doc)
    want = torch.nn.functional.cosine_similarity(
        torch.from_numpy(st.encode([q])[0]), torch.from_numpy(st.encode([d])[0]), dim=0)
    assert out.outputs.score == pytest.approx(want.item(), abs=1e-5)
    (plain,) = llm.score(query, doc, use_tqdm=False)
    assert abs(plain.outputs.score - out.outputs.score) > 1e-4
