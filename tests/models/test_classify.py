"""Sequence classification (``task="classify"``, ``LLM.classify``) and decoder
cross-encoders (``task="score"`` on ``*ForSequenceClassification`` decoders) against
transformers' ``AutoModelForSequenceClassification``: its logits, then softmax (classify) or
sigmoid (a one-label model's score), on tiny random Llama / Qwen2 / Qwen3 decoders (last
non-pad token pooled; transformers run on a right-padded batch) and BERT / RoBERTa encoders
(CLS pooled); labels from ``id2label``; the refusals.

Tolerance: everything runs in float32 on 2-layer, 64-wide models; the logits of the two
implementations differ by rounding only (about 1e-6 here: different GEMM and attention
kernels), and softmax / sigmoid have slopes below 1, so 1e-5 absolute on probabilities is
about 10x that rounding and still far below the gaps between the models' outputs."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams, SamplingParams
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder

ATOL = 1e-5
DECODERS = [("Qwen2", 3), ("Llama", 2), ("Qwen3", 4), ("Mixtral", 3), ("Qwen2Moe", 2),
            ("Qwen3Moe", 3)]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def build(kind: str, num_labels: int, encoder: bool = False, **kw) -> str:
        key = (kind, num_labels, encoder, tuple(sorted(kw.get("id2label", {}).items())))
        if key not in cache:
            folder = str(tmp_path_factory.mktemp(f"cls_{kind}_{num_labels}"))
            if encoder:
                build_cross_encoder(folder, kind, num_labels)
            else:
                build_decoder_classifier(folder, kind, num_labels, **kw)
            cache[key] = folder
        return cache[key]

    return build


def _probs(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.probs for o in outs])


@pytest.mark.parametrize("kind, num_labels", DECODERS)
def test_decoder_classify_matches_transformers(classifier, kind, num_labels, assert_no_leaks):
    folder = classifier(kind, num_labels)
    # 4-token steps: every text but one is pooled after two or more prefill chunks
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64,
              max_num_batched_tokens=4, block_size=4)
    pooler = llm.engine.processor.pooler
    assert (pooler.task, pooler.pooling_type, pooler.activation, pooler.num_labels,
            pooler.labels) == ("classify", "last", "softmax", num_labels,
                               tuple(f"LABEL_{i}" for i in range(num_labels)))
    ref = torch.softmax(hf_logits(folder, TEXTS), dim=-1)
    assert (ref.max(0).values - ref.min(0).values).max() > 0.05  # the texts are told apart
    outs = llm.classify(TEXTS, use_tqdm=False)
    torch.testing.assert_close(_probs(outs), ref, atol=ATOL, rtol=0)
    assert [o.outputs.num_classes for o in outs] == [num_labels] * len(TEXTS)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tokenizer(t)["input_ids"] for t in TEXTS]
    # token-id prompts, a dict prompt and a repeat (prefix-cache hits) give the same
    again = llm.classify([tokenizer(TEXTS[0])["input_ids"], {"prompt": TEXTS[1]}, TEXTS[2]],
                         use_tqdm=False)
    torch.testing.assert_close(_probs(again), ref[:3], atol=ATOL, rtol=0)
    assert_no_leaks(llm)


def test_encoder_classify_matches_transformers(classifier, assert_no_leaks):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    for kind, num_labels in [("Bert", 3), ("Roberta", 2)]:
        folder = classifier(kind, num_labels, encoder=True)
        llm = LLM(model=folder, dtype="float32", device="cpu", task="classify",
                  max_num_batched_tokens=64)
        assert llm.engine.processor.pooler.pooling_type == "cls"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            ref = torch.stack([torch.softmax(model(**tokenizer(t, return_tensors="pt"))
                                             .logits[0], dim=-1) for t in DOCUMENTS])
        torch.testing.assert_close(_probs(llm.classify(DOCUMENTS, use_tqdm=False)), ref,
                                   atol=ATOL, rtol=0)
        assert_no_leaks(llm)


def test_labels_come_from_id2label(classifier):
    folder = classifier("Qwen2", 2, id2label={0: "negative", 1: "positive"})
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=32)
    assert llm.engine.processor.pooler.labels == ("negative", "positive")


def test_decoder_score_is_the_sigmoid_of_its_one_logit(classifier, assert_no_leaks):
    """A one-label decoder classifier (a reranker such as Qwen3-Reranker's seq-cls form)
    scores a pair as sigmoid(logit) of the pair's tokens, the tokenizer's
    ``(text_1, text_2)`` encoding (here plain concatenation), as vLLM does; ``auto`` picks
    ``score`` for it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = classifier("Qwen3", 1)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64)
    pooler = llm.engine.processor.pooler
    assert (pooler.task, pooler.pooling_type, pooler.activation) == ("score", "last", "sigmoid")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = torch.stack([torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt"))
                                         .logits[0, 0]) for d in DOCUMENTS])
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref,
                               atol=ATOL, rtol=0)
    assert outs[0].prompt_token_ids == tokenizer(QUERY, DOCUMENTS[0])["input_ids"]
    assert_no_leaks(llm)


def test_bad_input_and_wrong_tasks_are_refused(classifier, tiny_llama, assert_no_leaks):
    folder = classifier("Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64,
              max_model_len=10)
    vocab = llm.engine.processor.vocab_size
    long = len(llm.get_tokenizer()(TEXTS[3])["input_ids"])
    assert long > 10
    bad = [
        (["paris", ""], "prompt 1: the prompt is empty: it must contain at least one token"),
        ([[3, vocab]], f"prompt 0: prompt token id {vocab} is outside the vocabulary [0, {vocab})"),
        ([TEXTS[3]], f"prompt 0: the prompt has {long} tokens but max_model_len is 10"),
    ]
    for prompts, message in bad:
        with pytest.raises(ValueError) as e:
            llm.classify(prompts, use_tqdm=False)
        assert str(e.value) == message
    refusal = ("this engine runs task='classify' (it classifies texts): use LLM.classify or "
               "/v1/classify; a {} request needs a model served with {}")
    with pytest.raises(ValueError) as e:  # three labels: no single relevance score
        llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)
    assert str(e.value) == (
        "this engine runs task='classify' with num_labels=3: it scores text pairs (LLM.score, "
        "/v1/score, /v1/rerank) only with a one-label classifier (num_labels == 1, a "
        "relevance logit); serve the model with task='score' for its 3 values per pair, or "
        "use LLM.classify or /v1/classify")
    with pytest.raises(ValueError) as e:
        llm.embed("paris", use_tqdm=False)
    assert str(e.value) == refusal.format("embed", "task='embed'")
    with pytest.raises(ValueError) as e:
        llm.generate("paris", SamplingParams(max_tokens=1), use_tqdm=False)
    assert str(e.value) == refusal.format("generate", "task='generate'")
    # the core refused it after the output processor took it: nothing may stay unfinished
    # (it did, and the next LLM call waited for it forever)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError) as e:
        llm.embed("paris", PoolingParams(task="classify"), use_tqdm=False)
    assert str(e.value) == ("LLM.embed takes PoolingParams with task='embed'; score text "
                            "pairs with LLM.score, classify texts with LLM.classify")
    assert_no_leaks(llm)
    # the engine keeps serving after the refusals
    torch.testing.assert_close(_probs(llm.classify(TEXTS[:2], use_tqdm=False)),
                               torch.softmax(hf_logits(folder, TEXTS[:2]), -1),
                               atol=ATOL, rtol=0)
    gen = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError) as e:
        gen.classify("paris")
    assert str(e.value) == (
        "this engine runs task='generate' (it generates text): use LLM.generate / LLM.chat "
        "or /v1/completions and /v1/chat/completions; a classify request needs a model "
        "served with task='classify' (a *ForSequenceClassification model)")
    with pytest.raises(ValueError, match="task='classify' needs a sequence classifier"):
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", task="classify")
    with pytest.raises(ValueError, match="it scores text pairs .task='score'. or classifies"):
        LLM(model=folder, dtype="float32", device="cpu", task="embed")


def test_classify_truncate_prompt_tokens(classifier, assert_no_leaks):
    """``LLM.classify(truncate_prompt_tokens=k)``: each text as the tokenizer truncates it
    to k tokens (as /classify cuts it), token ids their first k; oracle: transformers'
    probabilities of those ids."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = classifier("Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    cut_ids = [tokenizer(t, truncation=True, max_length=3)["input_ids"] for t in TEXTS]
    with torch.no_grad():
        ref = torch.stack([torch.softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
                           for ids in cut_ids])
    outs = llm.classify(TEXTS, truncate_prompt_tokens=3, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == cut_ids
    torch.testing.assert_close(_probs(outs), ref, atol=ATOL, rtol=0)
    # token ids keep their first k too (vLLM's pooling side; kvflow kept the last k)
    whole = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert any(ids[:3] != ids[-3:] for ids in whole)
    outs = llm.classify(whole, truncate_prompt_tokens=3, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids[:3] for ids in whole] == cut_ids
    torch.testing.assert_close(_probs(outs), ref, atol=ATOL, rtol=0)
    assert (ref - torch.softmax(hf_logits(folder, TEXTS), -1)).abs().max() > 0.01
    assert_no_leaks(llm)


@pytest.mark.parametrize("problem_type", ["multi_label_classification", "regression"])
def test_problem_type_picks_the_classify_activation(tmp_path, problem_type, assert_no_leaks):
    """config.json's ``problem_type`` picks the activation of classify (and of the decoder
    classifier's token_classify rows), as vLLM's ``get_act_fn`` and transformers'
    text-classification pipeline do: ``multi_label_classification`` a sigmoid per label,
    ``regression`` none (the logits); kvflow took the softmax over the labels. Oracle: the
    transformers pipeline's scores by label (it picks the function from ``problem_type``)."""
    import json

    from transformers import pipeline

    folder = str(tmp_path / "cls")
    build_decoder_classifier(folder, "Qwen2", 3)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    with open(f"{folder}/config.json", "w") as f:
        json.dump({**config, "problem_type": problem_type}, f)
    pipe = pipeline("text-classification", model=folder, top_k=None, device="cpu")
    ref = torch.tensor([[next(d["score"] for d in row if d["label"] == f"LABEL_{i}")
                         for i in range(3)] for row in pipe(TEXTS)])
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64,
              max_num_batched_tokens=4, block_size=4)
    outs = llm.classify(TEXTS, use_tqdm=False)
    torch.testing.assert_close(_probs(outs), ref, atol=ATOL, rtol=0)
    assert [o.outputs.num_classes for o in outs] == [3] * len(TEXTS)
    rows = llm.encode(TEXTS[0], pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(rows[-1], ref[0], atol=ATOL, rtol=0)  # the last token's row
    assert_no_leaks(llm)
