"""Cross-encoders (``task="score"``, ``LLM.score``) against sentence-transformers'
``CrossEncoder.predict`` and transformers' ``AutoModelForSequenceClassification`` (logits +
CrossEncoder's default activation: sigmoid for one label, none for several): tiny random
BERT (a WordPiece tokenizer giving token type 1 to the second text) and (XLM-)RoBERTa
classifiers, one and several labels, 1-to-N and N-to-N pairs, and the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.models.cross_encoder_models import (
    DOCUMENTS,
    QUERY,
    build_cross_encoder,
    hf_scores,
    st_scores,
)

CASES = [("Bert", 1), ("Bert", 3), ("XLMRoberta", 1), ("Roberta", 2)]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    cache: dict[tuple[str, int], str] = {}

    def build(kind: str, num_labels: int) -> str:
        if (kind, num_labels) not in cache:
            folder = str(tmp_path_factory.mktemp(f"ce_{kind}_{num_labels}"))
            build_cross_encoder(folder, kind, num_labels)
            cache[kind, num_labels] = folder
        return cache[kind, num_labels]

    return build


def _scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


@pytest.mark.parametrize("kind, num_labels", CASES)
def test_scores_match_cross_encoder_and_transformers(cross_encoder, kind, num_labels,
                                                     assert_no_leaks):
    folder = cross_encoder(kind, num_labels)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    core = llm.engine.core
    assert (core.task, core.is_encoder, core.pooler_config.activation) == \
        ("score", True, "sigmoid" if num_labels == 1 else "identity")
    one_to_n = [(QUERY, d) for d in DOCUMENTS]
    n_to_n = list(zip(DOCUMENTS[::-1], DOCUMENTS))
    for pairs, outs in [(one_to_n, llm.score(QUERY, DOCUMENTS, use_tqdm=False)),
                        (one_to_n, llm.score([QUERY], DOCUMENTS, use_tqdm=False)),
                        (n_to_n, llm.score(DOCUMENTS[::-1], DOCUMENTS, use_tqdm=False))]:
        got, st = _scores(outs), st_scores(folder, pairs)
        assert got.shape == st.shape == ((len(pairs),) if num_labels == 1
                                         else (len(pairs), num_labels))
        torch.testing.assert_close(got, st, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got, hf_scores(folder, pairs), atol=2e-5, rtol=1e-4)
    (single,) = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(single.outputs.score),
                               hf_scores(folder, [(QUERY, DOCUMENTS[0])])[0], atol=2e-5,
                               rtol=1e-4)
    assert single.prompt_token_ids == \
        llm.get_tokenizer()(QUERY, DOCUMENTS[0])["input_ids"]
    assert_no_leaks(llm)


def test_bert_token_types_change_the_score(cross_encoder):
    """The oracle can tell: the same BERT pair with every token type 0 scores differently,
    so the match above checks that the second text took token type 1."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = cross_encoder("Bert", 1)
    enc = AutoTokenizer.from_pretrained(folder)(QUERY, DOCUMENTS[0], return_tensors="pt")
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        typed = model(**enc).logits
        flat = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                     token_type_ids=torch.zeros_like(enc["input_ids"])).logits
    assert enc["token_type_ids"].sum() > 0
    assert (torch.sigmoid(typed) - torch.sigmoid(flat)).abs().item() > 1e-3


def test_bad_pairs_and_too_long_pairs_are_refused(cross_encoder, assert_no_leaks):
    folder = cross_encoder("Bert", 1)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
              max_model_len=16)
    bad = [
        (([QUERY, QUERY], DOCUMENTS), ("text_1 has 2 texts and text_2 6: score one text_1 "
         "against N texts (1-to-N) or two lists of the same length (N-to-N)")),
        (([], DOCUMENTS), "text_1 is an empty list: give at least one text"),
        ((QUERY, [DOCUMENTS[0], 5]), "text_2[1] must be a string, got int"),
        ((QUERY, ""), "text_2 is an empty string"),
        ((7, "x"), "text_1 must be a string or a list of strings, got int"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError) as e:
            llm.score(*args, use_tqdm=False)
        assert str(e.value) == message
    long_doc = DOCUMENTS[1]  # 9 tokens with the query's 6 and 3 special tokens: 18 > 16
    with pytest.raises(ValueError) as e:
        llm.score(QUERY, [DOCUMENTS[2], long_doc], use_tqdm=False)
    assert str(e.value) == (f"pair 1 (text_1={QUERY!r}, text_2={long_doc[:40]!r}): the prompt "
                            "has 18 tokens but max_model_len is 16")
    assert_no_leaks(llm)  # nothing was queued: the first pair was not scored either
    (cut,) = llm.score(QUERY, long_doc, truncate_prompt_tokens=16, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 16
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    enc = AutoTokenizer.from_pretrained(folder)(QUERY, long_doc, truncation="longest_first",
                                                max_length=16, return_tensors="pt")
    with torch.no_grad():
        ref = torch.sigmoid(AutoModelForSequenceClassification.from_pretrained(folder)(
            **enc).logits[0, 0])
    assert cut.prompt_token_ids == enc["input_ids"][0].tolist()
    assert abs(cut.outputs.score - ref.item()) < 2e-5
    with pytest.raises(ValueError) as e:
        llm.score(QUERY, long_doc, truncate_prompt_tokens=0, use_tqdm=False)
    assert str(e.value).endswith("truncate_prompt_tokens=0 is invalid: it must be an integer "
                                 ">= 1, or -1 (max_model_len)")
    (whole,) = llm.score(QUERY, long_doc, truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == cut.prompt_token_ids  # -1: max_model_len, here 16
    assert_no_leaks(llm)


def test_tasks(cross_encoder, tiny_llama, tmp_path, assert_no_leaks):
    folder = cross_encoder("XLMRoberta", 1)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
              task="score")
    refusal = ("this engine runs task='score' (it scores text pairs): use LLM.score or "
               "/v1/score and /v1/rerank (or LLM.classify, /v1/classify); a {} request needs "
               "a model served with task='{}'")
    with pytest.raises(ValueError) as e:
        llm.embed("the quick fox", use_tqdm=False)
    assert str(e.value) == refusal.format("embed", "embed")
    with pytest.raises(ValueError) as e:
        llm.generate("the quick fox", SamplingParams(max_tokens=2), use_tqdm=False)
    assert str(e.value) == refusal.format("generate", "generate")
    assert_no_leaks(llm)
    for task in ("embed", "generate"):
        with pytest.raises(ValueError) as e:
            LLM(model=folder, dtype="float32", device="cpu", task=task)
        assert str(e.value) == (f"task={task!r}: this architecture is a sequence "
                                "classifier (a *ForSequenceClassification head); it scores "
                                "text pairs (task='score') or classifies texts "
                                "(task='classify')")
    gen = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError) as e:
        gen.score("a", "b")
    assert str(e.value) == (
        "this engine runs task='generate' (it generates text): use LLM.generate / LLM.chat "
        "or /v1/completions and /v1/chat/completions; a score request needs a model served "
        "with task='score' (a cross-encoder) or task='embed' (cosine similarity)")
    with pytest.raises(ValueError, match="task='score' needs a sequence classifier"):
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", task="score")
    # an activation named in config.json (sentence-transformers >= 4) is the one applied
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    ident = tmp_path / "identity"
    shutil.copytree(folder, ident)
    (ident / "config.json").write_text(json.dumps(config))
    raw = LLM(model=str(ident), dtype="float32", device="cpu", max_num_batched_tokens=64)
    got = _scores(raw.score(QUERY, DOCUMENTS, use_tqdm=False))
    torch.testing.assert_close(got, st_scores(str(ident), [(QUERY, d) for d in DOCUMENTS]),
                               atol=2e-5, rtol=1e-4)
    assert (got < 0).any()  # logits, not sigmoids


def test_an_embedding_model_scores_by_cosine_similarity(tiny_tokenizer, tmp_path,
                                                        assert_no_leaks):
    """vLLM's rule for embedding models: score = cos(embed(text_1), embed(text_2)); the oracle
    is sentence-transformers' ``util.cos_sim`` of ``SentenceTransformer.encode`` (with
    ``truncate_prompt_tokens``: of its encode at that ``max_seq_length``)."""
    from sentence_transformers import util

    from tests.models.embedding_models import build_bert

    st = build_bert(tiny_tokenizer, str(tmp_path / "st"), "mean")
    llm = LLM(model=str(tmp_path / "st"), dtype="float32", device="cpu",
              max_num_batched_tokens=64)
    query, docs = "the quick brown fox", ["a lazy dog", "the quick brown fox jumps", "tokens"]
    for first, second in [(query, docs), (docs, docs[::-1])]:
        outs = llm.score(first, second, use_tqdm=False)
        lefts = [first] * len(second) if isinstance(first, str) else first
        expected = util.cos_sim(st.encode(lefts, convert_to_tensor=True),
                                st.encode(second, convert_to_tensor=True)).diagonal()
        torch.testing.assert_close(_scores(outs), expected.float(), atol=2e-5, rtol=1e-4)
        tok = llm.get_tokenizer()
        assert [o.prompt_token_ids for o in outs] == \
            [tok.encode(a) + tok.encode(b) for a, b in zip(lefts, second)]
    # truncate_prompt_tokens cuts each text on its own, as sentence-transformers cuts an
    # input to max_seq_length (the tokenizer's truncation, special tokens counted)
    st.max_seq_length = 4
    cut = util.cos_sim(st.encode([query], convert_to_tensor=True),
                       st.encode(docs, convert_to_tensor=True))[0].float()
    outs = llm.score(query, docs, truncate_prompt_tokens=4, use_tqdm=False)
    torch.testing.assert_close(_scores(outs), cut, atol=2e-5, rtol=1e-4)
    assert (cut - expected).abs().max() > 0.01  # the cut changed the scores
    assert [len(o.prompt_token_ids) for o in outs] == [4 + min(4, len(tok.encode(d)))
                                                       for d in docs]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=0 is invalid"):
        llm.score(query, docs, truncate_prompt_tokens=0)
    with pytest.raises(ValueError) as e:
        llm.score(query, " ".join(["fox"] * 200), use_tqdm=False)
    assert str(e.value).startswith("text 'fox fox fox")
    assert "max_model_len" in str(e.value)
    assert_no_leaks(llm)
