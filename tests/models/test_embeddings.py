"""Embedding models against sentence-transformers: a tiny random BERT encoder (CLS and mean
pooling, bidirectional attention, whole prompts per step) and a tiny random bare Llama decoder
(last-token and mean pooling over chunked prompts, prefix-cache hits for last-token pooling,
Matryoshka ``dimensions``), each saved as a sentence-transformers folder (modules.json,
1_Pooling/config.json, Normalize) and embedded by ``SentenceTransformer.encode`` one sentence
at a time."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

from kvflow import LLM, PoolingParams, SamplingParams
from tests.models.embedding_models import build_bert, build_decoder, build_roberta, st_embed

SENTENCES = ["the quick brown fox", ("prefix caching reuses them, chunked prefill splits long "
             "prompts, and preemption recomputes what it evicted while kvflow pages keys"),
             "a lazy dog", "keys and values through blocks of tokens; the quick brown fox jumps"]


@pytest.fixture(scope="module")
def bert_folder(tiny_tokenizer, tmp_path_factory):
    def build(pooling: str) -> tuple[str, Any]:
        folder = str(tmp_path_factory.mktemp(f"bert_{pooling}") / "st")
        return folder, build_bert(tiny_tokenizer, folder, pooling)

    return build


@pytest.fixture(scope="module")
def decoder_folder(tiny_tokenizer, tmp_path_factory):
    def build(pooling: str) -> tuple[str, Any]:
        folder = str(tmp_path_factory.mktemp(f"decoder_{pooling}") / "st")
        return folder, build_decoder(tiny_tokenizer, folder, pooling)

    return build


def _check(outs: list[Any], expected: list[torch.Tensor]) -> None:
    assert len(outs) == len(expected)
    for out, ref in zip(outs, expected):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        assert abs(got.norm().item() - 1.0) < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_bert_matches_sentence_transformers(bert_folder, pooling, assert_no_leaks):
    folder, st = bert_folder(pooling)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    core = llm.engine.core
    assert (core.task, core.is_encoder, core.pooler_config.pooling_type) == \
        ("embed", True, pooling)
    assert core.kv_cache_config.num_tensors == 0  # no KV cache for an encoder
    _check(llm.embed(SENTENCES, use_tqdm=False), st_embed(st, SENTENCES))
    assert_no_leaks(llm)


@pytest.mark.parametrize("options, named", [
    ({"num_kv_blocks": 64}, "num_kv_blocks=64"),
    ({"kv_cache_memory": "1GiB", "kv_cache_dtype": "int8"},
     "kv_cache_memory='1GiB', kv_cache_dtype='int8'"),
    ({"enable_prefix_caching": True}, "enable_prefix_caching=True"),
    ({"num_kv_blocks": 64, "enable_prefix_caching": True},
     "num_kv_blocks=64, enable_prefix_caching=True"),
])
def test_an_encoder_refuses_kv_cache_settings(bert_folder, options, named):
    """A BERT encoder keeps no KV cache (its pool has no tensor, as above): a size or element
    type given for one, or prefix caching asked for, was accepted and never read
    (``--no-enable-prefix-caching`` asks for what an encoder does, and passes)."""
    folder, _ = bert_folder("mean")
    them = "them" if "," in named else "it"
    with pytest.raises(ValueError) as e:
        LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64, **options)
    assert str(e.value) == (f"{named}: BertModel is an encoder-only model, which keeps no KV "
                            f"cache, so nothing reads {them}; leave {them} out")


def test_an_encoder_takes_prefix_caching_off(bert_folder):
    folder, st = bert_folder("cls")
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    _check(llm.embed(SENTENCES, use_tqdm=False), st_embed(st, SENTENCES))
    assert llm.engine.core.kv_cache_manager.enable_prefix_caching is False


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_decoder_pooling_every_token_refuses_prefix_caching(decoder_folder, pooling):
    """A decoder embedding model pooling other than its last token needs every prompt token's
    hidden state, so its engine keeps prefix caching off: asked for, it was never read."""
    folder, _ = decoder_folder(pooling)
    with pytest.raises(ValueError) as e:
        LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64,
            enable_prefix_caching=True)
    assert str(e.value) == (
        f"enable_prefix_caching=True: this engine embeds with {pooling} pooling, which needs "
        "every prompt token's hidden state, so a cached prefix would never be reused and "
        "prefix caching stays off (on only with last-token pooling); leave it out")


def test_a_decoder_pooling_its_last_token_takes_prefix_caching(decoder_folder):
    folder, st = decoder_folder("lasttoken")
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=8,
              num_kv_blocks=64, block_size=4, enable_prefix_caching=True)
    expected = st_embed(st, SENTENCES)
    _check(llm.embed(SENTENCES, use_tqdm=False), expected)
    _check(llm.embed(SENTENCES, use_tqdm=False), expected)
    assert llm.engine.core.kv_cache_manager.num_hits > 0


@pytest.mark.parametrize("xlm", [False, True], ids=["roberta", "xlm_roberta"])
def test_roberta_matches_sentence_transformers(tiny_tokenizer, tmp_path, xlm, assert_no_leaks):
    """RoBERTa / XLM-RoBERTa: positions from padding_idx + 1 (= 2), so 40 position rows cover
    38 tokens; a token-id prompt holding the padding id (1) gives it position padding_idx and
    does not count it, as transformers' RobertaModel does (mean of its last hidden state)."""
    st = build_roberta(tiny_tokenizer, str(tmp_path / "st"), "mean", xlm)
    llm = LLM(model=str(tmp_path / "st"), dtype="float32", device="cpu",
              max_num_batched_tokens=64)
    core = llm.engine.core
    assert (core.task, core.is_encoder, core.positions) == ("embed", True, 38)
    short = [SENTENCES[0], SENTENCES[2], SENTENCES[3]]
    _check(llm.embed(short, use_tqdm=False), st_embed(st, short))
    ids = [7, 1, 9, 30, 1, 1, 44] + list(range(50, 81))  # 38 tokens, the last position row
    with torch.no_grad():
        hidden = st[0].auto_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    (out,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    _check([out], [torch.nn.functional.normalize(hidden.mean(0), dim=0)])
    with pytest.raises(ValueError, match="39"):
        llm.embed([{"prompt_token_ids": ids + [5]}], use_tqdm=False)
    assert_no_leaks(llm)


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_decoder_matches_sentence_transformers(decoder_folder, pooling, assert_no_leaks):
    """Prompts longer than the 8-token step budget are pooled over several chunks."""
    folder, st = decoder_folder(pooling)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=8,
              num_kv_blocks=64, block_size=4)
    assert llm.engine.core.task == "embed"
    expected = st_embed(st, SENTENCES)
    _check(llm.embed(SENTENCES, use_tqdm=False), expected)
    _check(llm.embed(SENTENCES[::-1], use_tqdm=False), expected[::-1])  # again: cached
    kv = llm.engine.core.kv_cache_manager
    assert (kv.num_hits > 0) == (pooling == "lasttoken")  # mean pooling needs every token
    assert_no_leaks(llm)


def test_deterministic_mean_pooling_does_not_depend_on_the_chunks(decoder_folder):
    """--deterministic: a mean-pooled embedding is bitwise the same alone and beside other
    inputs, though an 8-token budget splits its prompt into other chunks in each batch (each
    chunk's sum was added to the running sum in float32, so the rounding followed the chunk
    boundaries: it differed in the last bits with the batch); and it still equals
    sentence-transformers'."""
    from kvflow.kernels import cpu_native

    if cpu_native.native_cpu_kernels() is None:
        pytest.skip("deterministic mode needs the native CPU kernels")
    folder, st = decoder_folder("mean")
    llm = LLM(model=folder, dtype="float32", device="cpu", deterministic=True,
              max_num_batched_tokens=8, num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False)
    target = SENTENCES[1]
    alone = llm.embed([target], use_tqdm=False)[0].outputs.embedding
    _check(llm.embed([target], use_tqdm=False), st_embed(st, [target]))
    for others in (SENTENCES[:1], SENTENCES[2:], [SENTENCES[0], "a b", "the lazy dog"]):
        batch = [*others, target]
        assert llm.embed(batch, use_tqdm=False)[-1].outputs.embedding == alone, others


def test_matryoshka_dimensions_and_users(decoder_folder, bert_folder):
    """``dimensions`` truncates; ``user`` names each prompt's client for the fair policy (as
    ``generate``'s does: the scheduler gets it; ``embed`` had no ``user`` and every embedding
    was the one anonymous client), a wrong count of names is a ValueError."""
    folder, st = decoder_folder("lasttoken")
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              policy="fair")
    sched, seen = llm.engine.core.scheduler, []
    add = sched.add_request
    sched.add_request = lambda request: (seen.append(request.client_id), add(request))
    full = st_embed(st, SENTENCES[:2])
    outs = llm.embed(SENTENCES[:2], PoolingParams(dimensions=16), use_tqdm=False,
                     user=["ann", "bob"])
    _check(outs, [torch.nn.functional.normalize(v[:16], dim=0) for v in full])
    assert seen == ["ann", "bob"]
    with pytest.raises(ValueError, match="user must be a list of 2"):
        llm.embed(SENTENCES[:2], user=["ann"])
    with pytest.raises(ValueError, match="dimensions=65"):
        llm.embed("hi", PoolingParams(dimensions=65))
    bert, _ = bert_folder("cls")
    with pytest.raises(ValueError, match="Matryoshka"):
        LLM(model=bert, dtype="float32", device="cpu").embed(
            "hi", PoolingParams(dimensions=16))


def test_tasks_and_bad_configs(decoder_folder, tiny_llama, tmp_path):
    folder, _ = decoder_folder("lasttoken")
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="user=.*fair"):  # only the fair policy reads it
        llm.embed("hi", user=["bob"])
    with pytest.raises(ValueError, match="task='generate'"):
        LLM(model=folder, task="generate")
    gen = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="task='embed'"):
        gen.embed("hi")
    # a causal LM served as an embedding model pools its last hidden state
    emb = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              task="embed")
    ids = emb.get_tokenizer().encode("the quick brown fox", return_tensors="pt")
    with torch.no_grad():
        hidden = tiny_llama.hf_model.model(input_ids=ids).last_hidden_state[0, -1]
    _check(emb.embed("the quick brown fox", use_tqdm=False),
           [torch.nn.functional.normalize(hidden, dim=0)])
    dense = str(tmp_path / "dense")
    shutil.copytree(folder, dense)
    with open(os.path.join(dense, "modules.json")) as f:
        modules = json.load(f)
    modules[-1]["type"] = "sentence_transformers.models.Dense"  # a projection after pooling
    with open(os.path.join(dense, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="Dense"):
        LLM(model=dense, dtype="float32", device="cpu", num_kv_blocks=64)


def _edit_json(path: str, **changes: Any) -> None:
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)


def test_sentence_transformers_text_settings(bert_folder):
    """sentence_bert_config.json's ``max_seq_length`` caps the context (sentence-transformers
    truncates there: kvflow refuses longer inputs rather than embed tokens the model never
    sees), ``do_lower_case`` lower-cases text and config_sentence_transformers.json's default
    prompt goes before each text, as sentence-transformers does (the oracle)."""
    from sentence_transformers import SentenceTransformer

    folder, _ = bert_folder("mean")
    _edit_json(os.path.join(folder, "sentence_bert_config.json"), max_seq_length=12,
               do_lower_case=True)
    _edit_json(os.path.join(folder, "config_sentence_transformers.json"),
               prompts={"query": "A ", "document": ""}, default_prompt_name="query")
    st = SentenceTransformer(folder, device="cpu")
    llm = LLM(model=folder, dtype="float32", device="cpu")
    assert llm.engine.processor.max_model_len == st.max_seq_length == 12
    texts = ["The Quick fox", "A LAZY dog"]
    _check(llm.embed(texts, use_tqdm=False), st_embed(st, texts))
    with pytest.raises(ValueError, match="max_model_len is 12"):
        llm.embed(" ".join(SENTENCES))
    with pytest.raises(ValueError, match="max_seq_length \\(12, sentence_bert_config.json\\)"):
        LLM(model=folder, dtype="float32", device="cpu", max_model_len=16)


@pytest.mark.parametrize("arch", ["BertForMaskedLM", "RobertaForMaskedLM",
                                  "XLMRobertaForMaskedLM"])
def test_masked_lm_checkpoint_embeds_with_its_encoder(tiny_tokenizer, tmp_path, arch):
    """A masked-LM checkpoint (``bert.`` / ``roberta.`` prefixed encoder + MLM head, as
    bert-base-uncased or xlm-roberta-base ship) embeds with its encoder: CLS pooling,
    normalized, equal to transformers' encoder output; the MLM head is not loaded."""
    import transformers

    from tests.models.embedding_models import _randomize

    kind = arch.removesuffix("ForMaskedLM")
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
        pad_token_id=1, architectures=[arch])
    model = getattr(transformers, arch)(config).eval()
    _randomize(model, 6)
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=64)
    assert llm.engine.core.task == "embed"
    ids = [5, 1, 17, 40, 99, 3, 250]
    encoder = getattr(model, "bert", None) or model.roberta
    with torch.no_grad():
        hidden = encoder(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
    (out,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    _check([out], [torch.nn.functional.normalize(hidden, dim=0)])


def _without_normalize(st: Any) -> Any:
    """The same sentence-transformers pipeline less its ``Normalize`` module: the raw pooled
    vector (the oracle of ``normalize=False``)."""
    from sentence_transformers import SentenceTransformer, models

    assert isinstance(st[-1], models.Normalize)
    return SentenceTransformer(modules=list(st)[:-1], device="cpu")


def test_normalize_false_gives_the_raw_pooled_vector(decoder_folder):
    """vLLM's ``PoolingParams.normalize``: False returns the pooled vector as pooled (cut to
    ``dimensions`` first, not normalized again), True normalizes, None follows the model
    (whose config normalizes); a non-bool, or one on another task, is a ValueError."""
    folder, st = decoder_folder("lasttoken")
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    raw = st_embed(_without_normalize(st), SENTENCES[:2])
    assert all(abs(v.norm().item() - 1.0) > 1e-2 for v in raw)  # the oracle is not unit
    for params, expected in ((PoolingParams(normalize=False), raw),
                             (PoolingParams(normalize=False, dimensions=16),
                              [v[:16] for v in raw]),
                             (PoolingParams(normalize=True), st_embed(st, SENTENCES[:2]))):
        outs = llm.embed(SENTENCES[:2], params, use_tqdm=False)
        for out, ref in zip(outs, expected):
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5,
                                       rtol=1e-4)
    for bad in ({"normalize": "yes"}, {"normalize": 1}, {"normalize": True, "task": "score"}):
        with pytest.raises(ValueError, match="PoolingParams.normalize"):
            PoolingParams(**bad)


def test_truncate_prompt_tokens_cuts_each_prompt(bert_folder, assert_no_leaks):
    """``LLM.embed(truncate_prompt_tokens=k)`` cuts as /v1/embeddings does: a text as
    sentence-transformers cuts it at ``max_seq_length`` k (the tokenizer's truncation,
    special tokens counted), token ids to their FIRST k as vLLM's pooling runner keeps them
    (oracle: sentence-transformers' forward over those k ids); -1 is max_model_len (nothing
    cut here); 0 is refused."""
    folder, st = bert_folder("mean")
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=64)
    whole = st_embed(st, SENTENCES)
    saved, st.max_seq_length = st.max_seq_length, 5
    try:
        cut = st_embed(st, SENTENCES)
    finally:
        st.max_seq_length = saved
    assert max((c - w).abs().max().item() for c, w in zip(cut, whole)) > 0.01
    _check(llm.embed(SENTENCES, truncate_prompt_tokens=5, use_tqdm=False), cut)
    _check(llm.embed(SENTENCES, truncate_prompt_tokens=-1, use_tqdm=False), whole)
    ids = llm.get_tokenizer()(SENTENCES[1])["input_ids"]
    with torch.no_grad():
        ref = st({"input_ids": torch.tensor([ids[:5]]),
                  "attention_mask": torch.ones(1, 5, dtype=torch.long)})["sentence_embedding"][0]
    (out,) = llm.embed([ids], truncate_prompt_tokens=5, use_tqdm=False)
    assert out.prompt_token_ids == ids[:5] != ids[-5:]
    _check([out], [ref])
    with pytest.raises(ValueError, match="truncate_prompt_tokens=0 is invalid"):
        llm.embed(SENTENCES, truncate_prompt_tokens=0)
    assert_no_leaks(llm)
