"""vLLM 0.32's ``--pooler-config`` / ``LLM(pooler_config=...)``: a tiny random BERT saved as a
sentence-transformers folder with MEAN pooling, served with ``pooling_type`` CLS, against the
CLS row sentence-transformers computes (its ``token_embeddings``, normalized by hand); a
``use_activation`` false (no normalization); a classifier's ``logit_mean`` / ``logit_sigma``
against transformers' logits calibrated by hand; the refusals (unknown keys named, fields
kvflow does not run)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams
from kvflow.config.model import ModelConfig
from tests.models.classifier_models import TEXTS, build_decoder_classifier, hf_logits
from tests.models.embedding_models import build_bert

SENTENCES = ["the quick brown fox", "a lazy dog sleeps in the sun", "keys and values"]


@pytest.fixture(scope="module")
def mean_bert(tiny_tokenizer, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bert_mean") / "st")
    return folder, build_bert(tiny_tokenizer, folder, "mean")


def _cls_rows(st, sentences: list[str]) -> list[torch.Tensor]:
    """sentence-transformers' final hidden state of each sentence's first ([CLS]) token."""
    return [st.encode([s], output_value="token_embeddings")[0][0].float() for s in sentences]


@pytest.mark.parametrize("given", [{"pooling_type": "CLS"}, '{"seq_pooling_type": "CLS"}'])
def test_pooling_type_cls_overrides_the_folders_mean(mean_bert, given):
    """The folder says MEAN (and Normalize); ``pooling_type`` CLS (a dict, or the flag's
    JSON text) pools the first token instead, still normalized."""
    folder, st = mean_bert
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
              pooler_config=given)
    assert llm.engine.core.pooler_config.pooling_type == "cls"
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(SENTENCES, use_tqdm=False)]
    mean = [torch.from_numpy(st.encode([s])[0]) for s in SENTENCES]
    for g, cls, m in zip(got, _cls_rows(st, SENTENCES), mean):
        torch.testing.assert_close(g, cls / cls.norm(), atol=2e-5, rtol=1e-4)
        assert (g - m).abs().max() > 1e-2  # not the folder's mean pooling


def test_use_activation_false_leaves_embeddings_unnormalized(mean_bert):
    folder, st = mean_bert
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
              pooler_config={"pooling_type": "CLS", "use_activation": False})
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(SENTENCES, use_tqdm=False)]
    for g, cls in zip(got, _cls_rows(st, SENTENCES)):
        torch.testing.assert_close(g, cls, atol=2e-5, rtol=1e-4)
        assert abs(g.norm().item() - 1.0) > 1e-2
    # a request's own value wins over the config's default
    out = llm.embed(SENTENCES[:1], use_tqdm=False,
                    pooling_params=PoolingParams(normalize=True))
    assert abs(torch.tensor(out[0].outputs.embedding).norm().item() - 1.0) < 1e-5


def test_logit_calibration_on_a_classifier(tmp_path):
    """softmax((logit - mean) / sigma), vLLM's ClassifierPoolerHead's calibration."""
    folder = str(tmp_path / "cls")
    build_decoder_classifier(folder, "Qwen2", 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", task="classify", num_kv_blocks=64,
              pooler_config={"logit_mean": 0.5, "logit_sigma": 0.25})
    got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    ref = torch.softmax((hf_logits(folder, TEXTS) - 0.5) / 0.25, dim=-1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert (got - torch.softmax(hf_logits(folder, TEXTS), -1)).abs().max() > 1e-2


@pytest.mark.parametrize("given, message", [
    ({"pooling_type": "CLS", "normalise": True, "pooling": 1},
     "unknown keys ['normalise', 'pooling']"),
    ({"normalize": True}, "normalize was removed in vLLM 0.32; use use_activation"),
    ({"pooling_type": "MAX"}, "pooling_type=\"MAX\" must be one of"),
    ({"pooling_type": "STEP"}, "STEP pooling"),
    ({"step_tag_id": 3}, "step_tag_id=3 is not supported"),
    ({"enable_chunked_processing": True}, "enable_chunked_processing=true is not supported"),
    ({"max_embed_len": 4096}, "max_embed_len=4096 is not supported"),
    ({"task": "classify"}, 'task="classify" is not supported'),
    ({"logit_sigma": 0}, "logit_sigma=0 must be non-zero"),
    ({"pooling_type": "CLS", "seq_pooling_type": "MEAN"}, "set one"),
    ("[1]", "must be a JSON object"),
])
def test_refusals_name_the_field(given, message):
    with pytest.raises(ValueError, match="--pooler-config") as e:
        ModelConfig(pooler_config=given)
    assert message in str(e.value)


def test_a_model_that_cannot_take_them_refuses(mean_bert):
    folder, _ = mean_bert
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        LLM(model=folder, dtype="float32", device="cpu", pooler_config={"dimensions": 8})
    with pytest.raises(ValueError, match="logit_mean calibrates a classification head"):
        LLM(model=folder, dtype="float32", device="cpu", pooler_config={"logit_mean": 1})


def test_the_serve_flag_and_its_default():
    from kvflow.config import EngineConfig
    from kvflow.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--pooler-config",
                                      '{"pooling_type": "MEAN", "dimensions": null}'])
    config = EngineConfig.from_cli_args(args).model_config
    assert config.pooler_config == {"pooling_type": "MEAN"}  # a null is the model's own
    assert ModelConfig().pooler_config is None
    assert ModelConfig(pooler_config="{}").pooler_config is None


def test_dimensions_is_the_default_of_embed_requests(tiny_tokenizer, tmp_path):
    """A Matryoshka decoder (``is_matryoshka``) served with ``dimensions`` 16: a request
    without ``dimensions`` gets sentence-transformers' vector cut to 16 and normalized again;
    one with its own ``dimensions`` keeps it."""
    from tests.models.embedding_models import build_decoder

    st = build_decoder(tiny_tokenizer, str(tmp_path / "st"), "lasttoken")
    llm = LLM(model=str(tmp_path / "st"), dtype="float32", device="cpu", num_kv_blocks=64,
              pooler_config={"dimensions": 16})
    full = torch.from_numpy(st.encode(["the quick brown fox"])[0])
    (out,) = llm.embed("the quick brown fox", use_tqdm=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               full[:16] / full[:16].norm(), atol=2e-5, rtol=1e-4)
    (own,) = llm.embed("the quick brown fox", PoolingParams(dimensions=32), use_tqdm=False)
    assert len(own.outputs.embedding) == 32
