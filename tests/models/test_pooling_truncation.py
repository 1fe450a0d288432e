"""``truncate_prompt_tokens`` on the offline pooling calls (``LLM.embed`` / ``encode`` /
``score``) keeps the FIRST k tokens, as vLLM 0.32's pooling runner does (it loads the
tokenizer with ``truncation_side="right"`` whatever the tokenizer's config says): a text as
the HF tokenizer loaded that way truncates it (``truncation=True, max_length=k``, its
special tokens kept), token ids their first k, a cross-encoder pair with the tokenizer's
``longest_first`` cut on the right. ``tokenization_kwargs``' ``truncation_side`` picks the
side of the whole encoding instead. The tokenizers here say ``truncation_side: left`` in
their config, so a cut on the tokenizer's own side shows. Oracles: the HF tokenizer loaded
with ``truncation_side="right"``, ids cut by hand, transformers' scores."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow import LLM
from kvflow.inputs.score import pair_prompt
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder

TEXT = "the quick brown fox jumps over a lazy dog"
OTHER = "a cat sat on the mat"


def _config_says_left(folder: str) -> None:
    """Make the tokenizer saved in ``folder`` truncate on the left by default."""
    path = f"{folder}/tokenizer_config.json"
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "truncation_side": "left"}, f)


@pytest.fixture(scope="module")
def embedder(tiny_tokenizer, tmp_path_factory):
    """(LLM, its tokenizer, the HF tokenizer as vLLM's pooling runner loads it) of a tiny
    BERT embedding model whose tokenizer writes ``<bos> text <eos>`` and whose config says
    left."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tests.models.embedding_models import build_bert

    folder = str(tmp_path_factory.mktemp("pool_trunc_bert") / "st")
    build_bert(tiny_tokenizer, folder, "mean")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 0)])
    tok.save_pretrained(folder)
    _config_says_left(folder)
    llm = LLM(model=folder, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    assert tok.truncation_side == "left"
    return llm, tok, AutoTokenizer.from_pretrained(folder, truncation_side="right")


def test_embed_keeps_the_first_tokens(embedder, assert_no_leaks):
    """A text: <bos>, its first k - 2 tokens, <eos> (HF's right truncation; it kept the
    last ones, the config's side); token ids their first k (they kept the last k); the
    vector that of those ids sent whole; LLM.encode alike."""
    llm, tok, right = embedder
    body = tok(TEXT, add_special_tokens=False).input_ids
    ids = tok(TEXT).input_ids
    assert len(body) > 4 and ids == [ids[0], *body, ids[-1]]
    want = [ids[0], *body[:2], ids[-1]]
    assert right(TEXT, truncation=True, max_length=4).input_ids == want
    (text_out,) = llm.embed(TEXT, truncate_prompt_tokens=4, use_tqdm=False)
    assert text_out.prompt_token_ids == want
    (direct,) = llm.embed([want], use_tqdm=False)
    assert text_out.outputs.embedding == direct.outputs.embedding
    (ids_out,) = llm.embed([ids], truncate_prompt_tokens=4, use_tqdm=False)
    assert ids_out.prompt_token_ids == ids[:4] != ids[-4:]
    (encoded,) = llm.encode([ids], truncate_prompt_tokens=4, use_tqdm=False,
                            pooling_task="embed")
    assert encoded.prompt_token_ids == ids[:4]
    assert_no_leaks(llm)


def test_tokenization_kwargs_truncation_side_picks_the_side(embedder, assert_no_leaks):
    """``tokenization_kwargs={"truncation_side": ...}`` with the ``truncate_prompt_tokens``
    keyword: the whole encoding's last ("left") or first ("right") k, <bos> / <eos> cut
    too, as vLLM slices after encoding."""
    llm, tok, _ = embedder
    ids = tok(TEXT).input_ids
    for side, want in (("left", ids[-4:]), ("right", ids[:4])):
        kwargs = {"truncation_side": side}
        outs = llm.embed([TEXT, ids], truncate_prompt_tokens=4, use_tqdm=False,
                         tokenization_kwargs=kwargs)
        assert [o.prompt_token_ids for o in outs] == [want, want]
    assert_no_leaks(llm)


def test_score_on_an_embedding_model_cuts_each_text_on_the_right(embedder):
    """LLM.score on an embedding model: each text cut as embed cuts it (its first tokens),
    the pair's ids both texts' cuts."""
    llm, _, right = embedder
    (out,) = llm.score(TEXT, OTHER, truncate_prompt_tokens=4, use_tqdm=False)
    want = [i for t in (TEXT, OTHER) for i in right(t, truncation=True, max_length=4).input_ids]
    assert out.prompt_token_ids == want


def test_score_on_an_embedding_model_takes_embeds_tokenization_kwargs(embedder):
    """vLLM 0.32's ``LLM.score(tokenization_kwargs=...)`` on an embedding model: each text
    cut as ``embed`` cuts it under the same kwargs (the whole encoding's last 4 tokens with
    ``truncation_side="left"``); ``chat_template`` is refused (cosine similarity renders no
    pair)."""
    llm, tok, _ = embedder
    (out,) = llm.score(TEXT, OTHER, use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 4,
                                            "truncation_side": "left"})
    assert out.prompt_token_ids == tok(TEXT).input_ids[-4:] + tok(OTHER).input_ids[-4:]
    with pytest.raises(ValueError, match="chat_template: an embedding model"):
        llm.score(TEXT, OTHER, use_tqdm=False, chat_template="{{ messages }}")


@pytest.fixture(scope="module")
def cross_encoder_left(tmp_path_factory):
    """(LLM, folder) of a tiny BERT cross-encoder whose tokenizer config says left."""
    folder = str(tmp_path_factory.mktemp("pool_trunc_ce"))
    build_cross_encoder(folder, "Bert", 1)
    _config_says_left(folder)
    return LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64), folder


def test_score_cuts_a_pair_as_vllm_does(cross_encoder_left, assert_no_leaks):
    """A cross-encoder pair: the tokenizer's ``longest_first`` cut on the right (vLLM's
    ``truncation=True`` on its right-side tokenizer; kvflow cut on the config's left),
    scored as transformers scores those ids; special tokens alone longer than k: the
    whole encoding's first k (vLLM's slice; kvflow refused it)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    llm, folder = cross_encoder_left
    right = AutoTokenizer.from_pretrained(folder, truncation_side="right")
    left = AutoTokenizer.from_pretrained(folder)
    assert left.truncation_side == "left"
    enc = right(QUERY, DOCUMENTS[1], truncation=True, max_length=12, return_tensors="pt")
    want = enc["input_ids"][0].tolist()
    assert want != left(QUERY, DOCUMENTS[1], truncation=True, max_length=12).input_ids
    (cut,) = llm.score(QUERY, DOCUMENTS[1], truncate_prompt_tokens=12, use_tqdm=False)
    assert cut.prompt_token_ids == want
    with torch.no_grad():
        ref = torch.sigmoid(AutoModelForSequenceClassification.from_pretrained(folder)(
            **enc).logits[0, 0]).item()
    assert cut.outputs.score == pytest.approx(ref, abs=2e-5)
    full = right(QUERY, DOCUMENTS[1]).input_ids
    (tiny,) = llm.score(QUERY, DOCUMENTS[1], truncate_prompt_tokens=2, use_tqdm=False)
    assert tiny.prompt_token_ids == full[:2]
    assert_no_leaks(llm)


def test_pair_prompt_on_a_named_side():
    """``truncation_side`` given: the whole pair's encoding cut to its last / first k, its
    token types alike (the second segment's start where the kept types turn 1)."""
    from tests.models.cross_encoder_models import bert_tokenizer

    tok = bert_tokenizer()
    enc = tok(QUERY, DOCUMENTS[1])
    ids, types = enc["input_ids"], enc["token_type_ids"]
    first_b = types.index(1)
    assert len(ids) - first_b > 5 and first_b > 5
    got, params = pair_prompt(tok, QUERY, DOCUMENTS[1], 5, "left")
    assert (got, params.second_segment_start) == (ids[-5:], 0)
    got, params = pair_prompt(tok, QUERY, DOCUMENTS[1], 5, "right")
    assert (got, params.second_segment_start) == (ids[:5], None)
    got, params = pair_prompt(tok, QUERY, DOCUMENTS[1], len(ids) - 2, "left")
    assert (got, params.second_segment_start) == (ids[2:], first_b - 2)
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right'"):
        pair_prompt(tok, QUERY, DOCUMENTS[1], 5, "middle")
    assert tok.truncation_side == "right"  # left as it was
