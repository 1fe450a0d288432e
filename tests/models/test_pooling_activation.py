"""vLLM's ``activation`` / ``use_activation`` (``PoolingParams``) offline: False gives a head
task's raw logits instead of their softmax / sigmoid, on classify, score and token_classify,
against transformers' logits (the default against torch.softmax / sigmoid of them); vLLM's
``token_classify`` on a decoder sequence classifier (its ``score`` head on every prompt token)
against the per-token logits transformers' ``Qwen2ForSequenceClassification`` computes before
it picks the last token (captured from its ``score`` module), over chunked prefill and a
prefix-cache hit the per-token request must not take; on the embedding tasks vLLM 0.32's
name of ``normalize``; the refusals (the two names disagreeing, a non-bool, an embedding
model's cosine scores, an encoder's token_classify)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.cross_encoder_models import DOCUMENTS, QUERY, build_cross_encoder
from tests.models.token_models import build_bare_decoder, build_token_classifier, hf_token_outputs

ATOL = 1e-5  # float32 rounding of two implementations (see test_classify.py)
# raw logits are not squashed into (0, 1): up to a few units here, so the same rounding is
# also allowed relative to their size
RAW = {"atol": ATOL, "rtol": 1e-5}
CHUNK = 16
LONG = " ".join(TEXTS)  # ~40 tokens: three prefill chunks of 16


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("act_qwen2"))
    build_decoder_classifier(folder, "Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64,
              max_num_batched_tokens=CHUNK, block_size=4)
    return llm, folder


def hf_per_token_logits(folder: str, text: str) -> torch.Tensor:
    """[T, num_labels]: the logits transformers' sequence classifier computes for every token
    (its ``score`` module's output, before the last-token pick)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    seen = []
    model.score.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        model(**AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt"))
    return seen[0][0].float()


def _probs(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.probs for o in outs])


def test_classify_raw_logits(classifier, assert_no_leaks):
    llm, folder = classifier
    logits = hf_logits(folder, TEXTS)
    torch.testing.assert_close(_probs(llm.classify(TEXTS, use_tqdm=False)),
                               torch.softmax(logits, -1), atol=ATOL, rtol=0)
    for params in (PoolingParams(activation=False), PoolingParams(use_activation=False),
                   PoolingParams(task="classify", activation=False, use_activation=False)):
        outs = llm.classify(TEXTS, use_tqdm=False, pooling_params=params)
        torch.testing.assert_close(_probs(outs), logits, **RAW)
    # one params per prompt: raw, default, explicit True
    mixed = llm.classify(TEXTS[:3], use_tqdm=False, pooling_params=[
        PoolingParams(activation=False), PoolingParams(), PoolingParams(use_activation=True)])
    torch.testing.assert_close(_probs(mixed)[0], logits[0], **RAW)
    torch.testing.assert_close(_probs(mixed)[1:], torch.softmax(logits[1:3], -1), atol=ATOL,
                               rtol=0)
    (enc,) = llm.encode(TEXTS[1], PoolingParams(use_activation=False), pooling_task="classify",
                        use_tqdm=False)
    torch.testing.assert_close(enc.outputs.data, logits[1], **RAW)
    assert_no_leaks(llm)


def test_token_classify_on_a_sequence_classifier(classifier, assert_no_leaks):
    llm, folder = classifier
    manager = llm.engine.core.kv_cache_manager
    assert llm.engine.processor.pooler.tasks == ("classify", "token_classify")
    assert manager.enable_prefix_caching  # last-token pooling keeps the cache
    llm.classify(LONG, use_tqdm=False)  # its blocks are cached: token_classify must not hit
    hits_before = manager.num_hits
    ref = hf_per_token_logits(folder, LONG)
    assert ref.shape[0] > 2 * CHUNK
    (out,) = llm.encode(LONG, pooling_task="token_classify", use_tqdm=False)
    torch.testing.assert_close(out.outputs.data, torch.softmax(ref, -1), atol=ATOL, rtol=0)
    (raw,) = llm.encode(LONG, PoolingParams(activation=False), pooling_task="token_classify",
                        use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, ref, **RAW)
    assert manager.num_hits == hits_before
    # the last token's row is the sequence's classification
    torch.testing.assert_close(raw.outputs.data[-1], hf_logits(folder, [LONG])[0], **RAW)
    assert_no_leaks(llm)


def test_score_raw_logits_on_a_cross_encoder(tmp_path, assert_no_leaks):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = str(tmp_path / "ce")
    build_cross_encoder(folder, "Bert", 1)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]
                              for d in DOCUMENTS])
    llm = LLM(model=folder, dtype="float32", device="cpu")  # auto: score
    scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    torch.testing.assert_close(scores, torch.sigmoid(logits), atol=ATOL, rtol=0)
    raw = llm.score(QUERY, DOCUMENTS, use_tqdm=False,
                    pooling_params=PoolingParams(activation=False))
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in raw]), logits, **RAW)
    # a score engine classifies too: the one logit of one text (token type 0), raw
    with torch.no_grad():
        text_logit = model(**tokenizer(QUERY, return_tensors="pt")).logits[0, 0].item()
    (cls,) = llm.classify(QUERY, use_tqdm=False,
                          pooling_params=PoolingParams(use_activation=False))
    assert cls.outputs.probs == pytest.approx([text_logit], abs=ATOL, rel=1e-5)
    # an encoder's head starts with the CLS pooler: no per-token head
    with pytest.raises(ValueError, match="a token_classify request needs"):
        llm.encode("paris", pooling_task="token_classify", use_tqdm=False)
    with pytest.raises(ValueError, match="PoolingParams.dimensions applies to embeddings"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False, pooling_params=PoolingParams(dimensions=2))
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_token_classifier_raw_logits(tmp_path, assert_no_leaks):
    folder = str(tmp_path / "tc")
    build_token_classifier(folder, "Llama", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64)
    logits = hf_token_outputs(folder, TEXTS[0], "token_classify")
    (raw,) = llm.encode(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, logits, **RAW)
    # vLLM 0.10's reward-model field: the same switch on the per-token task
    (raw,) = llm.encode(TEXTS[0], PoolingParams(softmax=False), use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, logits, **RAW)
    (probs,) = llm.encode(TEXTS[0], PoolingParams(softmax=True), use_tqdm=False)
    torch.testing.assert_close(probs.outputs.data, torch.softmax(logits, -1), atol=1e-5,
                               rtol=0)
    assert_no_leaks(llm)


def test_softmax_is_refused_off_token_classify(classifier, assert_no_leaks):
    """vLLM 0.10 takes softmax on its per-token encode task only: classify, score and the
    embedding tasks refuse it by name (nothing is queued)."""
    llm, _ = classifier
    match = r"softmax \(vLLM 0.10's reward-model field\) applies to token_classify"
    with pytest.raises(ValueError, match=match):
        llm.classify(TEXTS[0], pooling_params=PoolingParams(softmax=False), use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        llm.encode(TEXTS[0], PoolingParams(softmax=True), pooling_task="classify",
                   use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": True, "use_activation": False}, "and use_activation=False disagree"),
    ({"activation": 0}, "activation=0 must be a bool"),
    ({"use_activation": "false"}, "use_activation='false' must be a bool"),
    ({"softmax": 1}, "softmax=1 must be a bool"),
    ({"activation": True, "softmax": False}, "activation=True and softmax=False disagree"),
])
def test_pooling_params_refuse_bad_activation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


def test_embedding_tasks_take_use_activation_as_normalize(tmp_path, assert_no_leaks):
    """vLLM 0.32 reads ``use_activation`` on embed and token_embed as the embedding's L2
    normalization (it removed ``normalize``): False gives the raw last-token vector / rows,
    True (and unset, this model's default) normalized ones; ``activation`` is the same name
    here; ``normalize`` disagreeing with it is refused. Oracle: transformers'
    ``last_hidden_state`` (was: a ValueError naming activation)."""
    folder = str(tmp_path / "emb")
    build_bare_decoder(folder)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64)
    rows = hf_token_outputs(folder, TEXTS[0], "token_embed")
    unit = torch.nn.functional.normalize(rows, dim=-1)

    def vector(params):
        return torch.tensor(llm.embed(TEXTS[0], params, use_tqdm=False)[0].outputs.embedding)

    def token_rows(params):
        return llm.encode(TEXTS[0], params, pooling_task="token_embed",
                          use_tqdm=False)[0].outputs.data

    torch.testing.assert_close(vector(PoolingParams(use_activation=False)), rows[-1], **RAW)
    torch.testing.assert_close(vector(PoolingParams(activation=False)), rows[-1], **RAW)
    torch.testing.assert_close(vector(PoolingParams(use_activation=True)), unit[-1], **RAW)
    torch.testing.assert_close(vector(None), unit[-1], **RAW)
    torch.testing.assert_close(vector(PoolingParams(normalize=False, use_activation=False)),
                               rows[-1], **RAW)
    torch.testing.assert_close(token_rows(PoolingParams(use_activation=False)), rows, **RAW)
    torch.testing.assert_close(token_rows(PoolingParams(use_activation=True)), unit, **RAW)
    with pytest.raises(ValueError, match="normalize=True and use_activation=False disagree"):
        PoolingParams(normalize=True, use_activation=False)
    with pytest.raises(ValueError, match="activation: an embedding model scores by cosine"):
        llm.score("a", "b", pooling_params=PoolingParams(activation=False), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)
