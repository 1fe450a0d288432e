"""vLLM's per-token pooling tasks offline (``LLM.encode(pooling_task="token_classify" /
"token_embed")``) against transformers: a tiny random ``LlamaForTokenClassification`` /
``Qwen2ForTokenClassification``'s softmax(logits) per token and a bare ``LlamaModel``'s
``last_hidden_state`` (L2-normalized per token, the model's default, or raw), with prompts
longer than the step's token budget (chunked prefill: every chunk's rows kept) and a
prefix-cache hit that a per-token request must not take; the refusals."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, PoolingParams
from tests.models.classifier_models import TEXTS
from tests.models.token_models import build_bare_decoder, build_token_classifier, hf_token_outputs

CHUNK = 16  # --max-num-batched-tokens: the long prompts below take 2-3 steps
LONG = " ".join(TEXTS)  # ~40 tokens


@pytest.fixture(scope="module", params=["Llama", "Qwen2"])
def token_classifier(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"tokcls_{request.param}"))
    build_token_classifier(folder, request.param, 3)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=CHUNK)
    return llm, folder


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tokemb"))
    build_bare_decoder(folder)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=CHUNK, block_size=4)
    return llm, folder


def test_token_classify_matches_transformers_softmax_per_token(token_classifier,
                                                               assert_no_leaks):
    llm, folder = token_classifier
    core = llm.engine.core
    assert core.task == "token_classify"
    assert not core.kv_cache_manager.enable_prefix_caching  # every token's row is pooled
    prompts = [TEXTS[0], LONG, TEXTS[2]]
    for task in (None, "token_classify"):
        outs = llm.encode(prompts, pooling_task=task, use_tqdm=False)
        for text, out in zip(prompts, outs):
            ref = torch.softmax(hf_token_outputs(folder, text, "token_classify"), dim=-1)
            assert out.outputs.data.shape == (len(out.prompt_token_ids), 3) == ref.shape
            torch.testing.assert_close(out.outputs.data, ref, atol=1e-5, rtol=0)
    assert len(outs[1].prompt_token_ids) > 2 * CHUNK  # chunked over three steps
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"pooling_task": "token_embed"}, "task='token_classify'"),
    ({"pooling_task": "classify"}, "task='token_classify'"),
    ({"pooling_params": PoolingParams(normalize=True)}, "normalize applies to embeddings"),
])
def test_token_classifier_refuses_other_tasks(token_classifier, kwargs, match):
    llm, _ = token_classifier
    with pytest.raises(ValueError, match=match):
        llm.encode("paris", use_tqdm=False, **kwargs)


def test_token_classifier_refuses_other_engine_tasks(tmp_path):
    build_token_classifier(str(tmp_path), "Llama", 2)
    with pytest.raises(ValueError, match="token classifier"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", task="classify")


def test_token_embed_matches_transformers_hidden_states(decoder_embedder, assert_no_leaks):
    llm, folder = decoder_embedder
    manager = llm.engine.core.kv_cache_manager
    assert manager.enable_prefix_caching  # last-token pooling keeps the cache on
    # an embed request computes LONG and publishes its blocks; the token_embed requests
    # after it must not take them (the hit tokens' rows would be missing)
    llm.embed(LONG, use_tqdm=False)
    hits_before = manager.num_hits
    ref = hf_token_outputs(folder, LONG, "token_embed")
    (out,) = llm.encode(LONG, pooling_task="token_embed", use_tqdm=False)
    assert out.outputs.data.shape == ref.shape and ref.shape[0] > 2 * CHUNK
    torch.testing.assert_close(out.outputs.data, torch.nn.functional.normalize(ref, dim=-1),
                               atol=1e-5, rtol=0)
    assert manager.num_hits == hits_before
    raw = llm.encode([LONG, TEXTS[1]], PoolingParams(normalize=False),
                     pooling_task="token_embed", use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(raw[1].outputs.data,
                               hf_token_outputs(folder, TEXTS[1], "token_embed"),
                               atol=1e-4, rtol=1e-4)
    # the embedding is the last token's row, as token_embed gives it
    (vec,) = llm.encode(LONG, use_tqdm=False)
    torch.testing.assert_close(vec.outputs.data, out.outputs.data[-1], atol=1e-5, rtol=0)
    # a per-token request's own blocks stay cached: an embed request of a prompt first
    # seen by token_embed takes them
    fresh = f"{TEXTS[4]} {TEXTS[5]}"
    llm.encode(fresh, pooling_task="token_embed", use_tqdm=False)
    hits_before = manager.num_hits
    llm.embed(fresh, use_tqdm=False)
    assert manager.num_hits - hits_before >= 4  # one block or more
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"pooling_task": "token_classify"}, "task='embed'"),
    ({"pooling_task": "encode"}, "token_embed"),
    ({"pooling_task": "reward"}, "must be one of"),
])
def test_embedder_refuses_token_classify(decoder_embedder, kwargs, match):
    llm, _ = decoder_embedder
    with pytest.raises(ValueError, match=match):
        llm.encode("paris", use_tqdm=False, **kwargs)


def test_token_classifier_refuses_prefix_caching(tmp_path):
    build_token_classifier(str(tmp_path), "Qwen2", 2)
    with pytest.raises(ValueError, match="enable_prefix_caching=True: this engine classifies "
                                         "every prompt token"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", enable_prefix_caching=True)
