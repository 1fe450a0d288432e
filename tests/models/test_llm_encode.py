"""``LLM.encode`` (vLLM's offline pooling call): each prompt's pooled output as a float32
tensor, against independent oracles: sentence-transformers' ``encode`` for a tiny random
BERT embedding model (mean pooling, normalized) and transformers'
``AutoModelForSequenceClassification`` softmax for a tiny random Qwen2 classifier; the
pooling task resolved from the engine or asked for; the refusals (generating engine, tasks
kvflow's encode does not run, LoRA, PoolingParams of another task or with fields the task
refuses)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow import LLM, PoolingParams, PoolingRequestOutput
from kvflow.lora.request import LoRARequest
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.embedding_models import build_bert, st_embed

SENTENCES = ["the quick brown fox", "a lazy dog", "keys and values through blocks of tokens"]


@pytest.fixture(scope="module")
def bert(tiny_tokenizer, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("encode_bert") / "st")
    st = build_bert(tiny_tokenizer, folder, "mean")
    return LLM(model=folder, dtype="float32", device="cpu"), st


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("encode_cls"))
    build_decoder_classifier(folder, "Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64)
    return llm, folder


def test_embedding_model_encodes_its_embeddings(bert, assert_no_leaks):
    llm, st = bert
    outs = llm.encode(SENTENCES, use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outs)
    assert all(o.outputs.data.dtype == torch.float32 for o in outs)
    expected = st_embed(st, SENTENCES)
    for out, ref in zip(outs, expected):
        assert out.outputs.data.shape == ref.shape
        torch.testing.assert_close(out.outputs.data, ref, atol=2e-5, rtol=1e-4)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tokenizer.encode(s) for s in SENTENCES]
    # the same values as embed's lists, bit for bit; explicit task and params are honoured
    embedded = llm.embed(SENTENCES, use_tqdm=False)
    assert all(torch.equal(o.outputs.data, torch.tensor(e.outputs.embedding))
               for o, e in zip(outs, embedded))
    raw = llm.encode(SENTENCES[0], PoolingParams(normalize=False), pooling_task="embed",
                     lora_request=[None])[0].outputs.data
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=0), expected[0],
                               atol=2e-5, rtol=1e-4)
    assert abs(raw.norm().item() - 1.0) > 1e-2  # not normalized: the pooled mean itself
    assert_no_leaks(llm)


def test_classifier_encodes_its_class_probabilities(classifier, assert_no_leaks):
    llm, folder = classifier
    ref = torch.softmax(hf_logits(folder, TEXTS), dim=-1)
    for task in (None, "classify"):
        outs = llm.encode(TEXTS, pooling_task=task, use_tqdm=False)
        got = torch.stack([o.outputs.data for o in outs])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    classified = llm.classify(TEXTS, use_tqdm=False)
    assert all(o.outputs.data.tolist() == c.outputs.probs for o, c in zip(outs, classified))
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"pooling_task": "embed"}, "task='classify'"),  # the engine runs classify
    ({"pooling_task": "score"}, "LLM.score"),
    ({"pooling_task": "token_embed"}, "task='embed' \\(an embedding model\\)"),
    ({"pooling_task": "encode"}, "'token_embed' \\(an embedding engine\\) or"),
    ({"pooling_task": "reward"}, ("must be one of embed, classify, token_embed, "
                                  "token_classify or None")),
    # a list (unhashable) was a TypeError from the dict lookup, not the ValueError
    ({"pooling_task": ["token_embed"]}, "pooling_task=\\['token_embed'\\] must be a string"),
    ({"pooling_task": 1}, "pooling_task=1 must be a string"),
    ({"pooling_params": PoolingParams(normalize=False)}, "normalize applies to embeddings"),
    ({"pooling_params": PoolingParams(task="score")}, "task='score' but the pooling task"),
    ({"pooling_params": [PoolingParams()] * 2}, "got 2 PoolingParams for 1 prompts"),
    ({"lora_request": LoRARequest("a", 1, "/nowhere")}, "runs no LoRA adapters"),
])
def test_classifier_refusals_queue_nothing(classifier, kwargs, match):
    llm, _ = classifier
    with pytest.raises(ValueError, match=match):
        llm.encode(TEXTS[0], use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_every_pooling_call_takes_vllms_lora_request_and_refuses_an_adapter(
        bert, classifier, assert_no_leaks):
    """``embed``, ``classify`` and ``score`` take vLLM's ``lora_request`` keyword (it was a
    TypeError, unlike ``encode``): None per prompt gives the same values as without it, an
    adapter is refused as ``encode`` refuses it (pooling engines run none: they refuse
    enable_lora), nothing queued."""
    embedder, _ = bert
    llm, _ = classifier
    adapter = LoRARequest("a", 1, "/nowhere")
    calls = {"embed": (embedder, lambda lr: embedder.embed(SENTENCES[:2], use_tqdm=False,
                                                           lora_request=lr)),
             "score": (embedder, lambda lr: embedder.score(SENTENCES[0], SENTENCES[1:],
                                                           use_tqdm=False, lora_request=lr)),
             "classify": (llm, lambda lr: llm.classify(TEXTS[:2], use_tqdm=False,
                                                       lora_request=lr))}
    for name, (engine, call) in calls.items():
        plain, nones = call(None), call([None, None])
        values = [dataclasses.astuple(o.outputs) for o in plain]
        assert [dataclasses.astuple(o.outputs) for o in nones] == values, name
        for lora in (adapter, [None, adapter]):
            with pytest.raises(ValueError, match="lora_request: a pooling engine runs no LoRA"):
                call(lora)
            assert not engine.engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="a list of 2 of them"):
            call([None])
    assert_no_leaks(embedder)
    assert_no_leaks(llm)


def test_a_generating_engine_refuses_encode(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16)
    for task in (None, "embed"):
        with pytest.raises(ValueError, match="this model generates text"):
            llm.encode("hi", pooling_task=task)
