"""LLM-as-reranker checkpoints served as sequence classifiers through ``hf_overrides``
(vLLM's Qwen3-Reranker recipe): a causal LM's ``classifier_from_token`` rows of the LM head
(or tied embedding) become the score head. Oracle: transformers' causal LM on the same
tokens, its last-token logits: softmax over the "no" / "yes" logits (P(yes)) for
``from_2_way_softmax`` / ``is_original_qwen3_reranker``, the token's own logit through a
sigmoid for a one-token ``no_post_processing``. Also one engine serving both score and
classify (a classify engine scores with one label; a score engine classifies), and the
refusals of bad override values, each named.

Tolerance: float32 on 2-layer, 64-wide models; the logits of the two implementations differ
by rounding (~1e-6) and sigmoid / softmax have slopes below 1: 1e-5 absolute."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from tests.models.classifier_models import (
    NO_TOKEN,
    TEXTS,
    YES_TOKEN,
    build_causal_reranker,
    build_decoder_classifier,
    hf_last_token_logits,
    hf_reranker_scores,
)
from tests.models.cross_encoder_models import DOCUMENTS, QUERY

ATOL = 1e-5
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": [NO_TOKEN, YES_TOKEN],
                  "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def build(kind: str = "Qwen3", tied: bool = False) -> str:
        if (kind, tied) not in cache:
            folder = str(tmp_path_factory.mktemp(f"reranker_{kind}_{tied}"))
            build_causal_reranker(folder, kind, tied)
            cache[kind, tied] = folder
        return cache[kind, tied]

    return build


def _pair_ids(llm: LLM, docs: list[str]) -> list[list[int]]:
    return [llm.get_tokenizer()(QUERY, d)["input_ids"] for d in docs]


@pytest.mark.parametrize("kind, tied, overrides", [
    ("Qwen3", False, QWEN3_RERANKER),
    ("Qwen2", False, {"architectures": ["Qwen2ForSequenceClassification"],
                      "classifier_from_token": [NO_TOKEN, YES_TOKEN],
                      "method": "from_2_way_softmax"}),
    ("Llama", True, {"architectures": ["LlamaForSequenceClassification"],
                     "classifier_from_token": [NO_TOKEN, YES_TOKEN],
                     "method": "from_2_way_softmax"}),
    ("Qwen3Moe", False, {"architectures": ["Qwen3MoeForSequenceClassification"],
                         "classifier_from_token": [NO_TOKEN, YES_TOKEN],
                         "method": "from_2_way_softmax"}),
], ids=["qwen3_original", "qwen2_method", "llama_tied", "qwen3_moe"])
def test_score_is_p_yes_of_the_causal_lm(reranker, kind, tied, overrides, assert_no_leaks):
    folder = reranker(kind, tied)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=4, block_size=4, hf_overrides=overrides)  # chunked
    pooler = llm.engine.processor.pooler
    assert (pooler.task, pooler.pooling_type, pooler.activation, pooler.num_labels) == \
        ("score", "last", "sigmoid", 1)
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    ids = _pair_ids(llm, DOCUMENTS)
    assert [o.prompt_token_ids for o in outs] == ids
    expected = hf_reranker_scores(folder, ids)
    assert expected.max() - expected.min() > 0.05  # the documents are told apart
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), expected,
                               atol=ATOL, rtol=0)
    assert_no_leaks(llm)


def test_one_token_no_post_processing_and_classify(reranker, assert_no_leaks):
    """``no_post_processing``: one label per token, its LM-head row; a classify engine gives
    the softmax over the tokens' logits for two tokens and, with one token (one label), the
    sigmoid of that logit for both classify and score (vLLM's PoolerClassify / PoolerScore)."""
    folder = reranker("Qwen3")
    base = {"architectures": ["Qwen3ForSequenceClassification"], "method": "no_post_processing"}
    ids = None
    for tokens in ([YES_TOKEN], [NO_TOKEN, YES_TOKEN]):
        llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, task="classify",
                  hf_overrides={**base, "classifier_from_token": tokens})
        tok = llm.get_tokenizer()
        ids = ids or [tok(t)["input_ids"] for t in TEXTS]
        rows = tok.convert_tokens_to_ids(tokens)
        logits = hf_last_token_logits(folder, ids)[:, rows]
        probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
        if len(tokens) == 1:
            torch.testing.assert_close(probs, torch.sigmoid(logits), atol=ATOL, rtol=0)
            pair = llm.get_tokenizer()(QUERY, DOCUMENTS[0])["input_ids"]
            score = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)[0].outputs.score
            assert score == pytest.approx(
                float(torch.sigmoid(hf_last_token_logits(folder, [pair])[0, rows[0]])),
                abs=ATOL)
        else:
            torch.testing.assert_close(probs, torch.softmax(logits, -1), atol=ATOL, rtol=0)
        assert_no_leaks(llm)


def test_a_classify_engine_scores_with_one_label(reranker, assert_no_leaks):
    folder = reranker("Qwen3")
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, task="classify",
              hf_overrides=QWEN3_RERANKER)
    assert llm.engine.processor.pooler.tasks == ("classify", "score", "token_classify")
    ids = _pair_ids(llm, DOCUMENTS[:3])
    expected = hf_reranker_scores(folder, ids)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS[:3], use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(scores), expected, atol=ATOL, rtol=0)
    probs = [o.outputs.probs for o in llm.classify([{"prompt_token_ids": i} for i in ids],
                                                   use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(probs)[:, 0], expected, atol=ATOL, rtol=0)
    assert_no_leaks(llm)


def test_a_score_engine_classifies(tmp_path, assert_no_leaks):
    from tests.models.classifier_models import hf_logits

    folder = str(tmp_path / "cls")
    build_decoder_classifier(folder, "Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64)  # auto: score
    assert llm.engine.processor.pooler.tasks == ("score", "classify", "token_classify")
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS[:3], use_tqdm=False)])
    torch.testing.assert_close(probs, torch.softmax(hf_logits(folder, TEXTS[:3]), -1),
                               atol=ATOL, rtol=0)
    assert_no_leaks(llm)


@pytest.mark.parametrize("overrides, message", [
    ({"classifier_from_token": [NO_TOKEN, YES_TOKEN], "is_original_qwen3_reranker": True},
     ("classifier_from_token builds a sequence classifier's score head, but the model's "
     "architectures are ['Qwen3ForCausalLM']")),
    ({**QWEN3_RERANKER, "classifier_from_token": [YES_TOKEN]},
     ("method='from_2_way_softmax' (or is_original_qwen3_reranker) takes two tokens [false, "
     "true] in classifier_from_token, got ['Ġthe']")),
    ({**QWEN3_RERANKER, "classifier_from_token": ["no", "yes"]},
     "classifier_from_token: 'no' is not a token of the model's vocabulary"),
    ({**QWEN3_RERANKER, "classifier_from_token": "yes"},
     ("method='from_2_way_softmax' needs classifier_from_token, a list of token strings, got "
     "'yes'")),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Ġthe"]},
     "classifier_from_token=['Ġthe'] needs a \"method\""),
    ({**QWEN3_RERANKER, "method": "softmax"},
     "method='softmax' is not a classifier conversion kvflow knows"),
], ids=["causal_lm_architecture", "one_token", "not_in_vocab", "not_a_list", "no_method",
        "unknown_method"])
def test_bad_overrides_are_named(reranker, overrides, message):
    with pytest.raises(ValueError) as e:
        LLM(model=reranker("Qwen3"), dtype="float32", device="cpu", num_kv_blocks=64,
            hf_overrides=overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_a_converted_checkpoint_is_not_converted_again(tmp_path):
    folder = str(tmp_path / "seq_cls")
    build_decoder_classifier(folder, "Qwen3", 1)
    with pytest.raises(ValueError, match="builds the score head from lm_head.weight; the "
                                         "checkpoint lacks it"):
        LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
            hf_overrides={"classifier_from_token": [NO_TOKEN, YES_TOKEN],
                          "is_original_qwen3_reranker": True})
