"""BERT and (XLM-)RoBERTa ``*ForTokenClassification`` under ``task token_classify`` (vLLM's
per-token task) against transformers: tiny random models' per-token softmax(logits), the raw
logits with ``activation=False``, a batch of prompts of different lengths, and the refusals
of another task."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams
from tests.models.classifier_models import TEXTS
from tests.models.cross_encoder_models import build_cross_encoder
from tests.models.token_models import hf_token_outputs


@pytest.fixture(scope="module", params=["Bert", "Roberta", "XLMRoberta"])
def encoder_token_classifier(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"enc_tokcls_{request.param}"))
    build_cross_encoder(folder, request.param, 4, seed=23, head="TokenClassification")
    return LLM(model=folder, dtype="float32", device="cpu"), folder


def test_encoder_token_classify_matches_transformers(encoder_token_classifier,
                                                     assert_no_leaks):
    llm, folder = encoder_token_classifier
    assert llm.engine.core.task == "token_classify"
    prompts = TEXTS[:3]
    outs = llm.encode(prompts, use_tqdm=False)
    for text, out in zip(prompts, outs):
        logits = hf_token_outputs(folder, text, "token_classify")
        ref = torch.softmax(logits, dim=-1)
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 4) == ref.shape
        torch.testing.assert_close(out.outputs.data, ref, atol=1e-5, rtol=0)
    raw = llm.encode(prompts[1], pooling_params=PoolingParams(activation=False),
                     use_tqdm=False)[0]
    torch.testing.assert_close(raw.outputs.data, hf_token_outputs(folder, prompts[1],
                                                                  "token_classify"),
                               atol=1e-5, rtol=0)
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"pooling_task": "token_embed"}, "task='token_classify'"),
    ({"pooling_task": "classify"}, "task='token_classify'"),
])
def test_encoder_token_classifier_refuses_other_tasks(encoder_token_classifier, kwargs,
                                                      match):
    llm, _ = encoder_token_classifier
    with pytest.raises(ValueError, match=match):
        llm.encode("paris", use_tqdm=False, **kwargs)


def test_encoder_token_classifier_refuses_another_engine_task(tmp_path):
    build_cross_encoder(str(tmp_path), "Bert", 2, head="TokenClassification")
    with pytest.raises(ValueError, match="token classifier"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", task="embed")
