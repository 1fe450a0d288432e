"""Disaggregated prefill through SharedStorageConnector (``kv_transfer_config``), offline.

A producer engine runs each prompt with ``max_tokens=1`` and stores its full prompt blocks
in a folder; a fresh consumer engine (another ``LLM``, same folder) loads them instead of
computing them. Oracles: HF transformers (greedy tokens; the stored K/V against its
``past_key_values``), a plain kvflow engine without a connector (logprobs), and hand counts
from the block size (a prompt of ``L`` tokens loads ``(L - 1) // BLOCK_SIZE`` whole blocks,
never its last token; the consumer runs only the rest through the model).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, KVTransferConfig
from kvflow.distributed.kv_transfer.shared_storage import SharedStorageScheduler
from kvflow.distributed.kv_transfer.storage_keys import block_keys
from kvflow.distributed.kv_transfer.storage_paths import block_path
from kvflow.distributed.kv_transfer.storage_worker import SharedStorageWorker
from kvflow.lora.request import LoRARequest
from tests.conftest import build_tiny_model
from tests.distributed.conftest import SLOW, slow
from tests.lora.adapters import MAX_TOKENS as LORA_MAX_TOKENS
from tests.lora.adapters import make_adapter, peft_greedy
from tests.test_prompt_embeds import MAX_TOKENS as EMBEDS_MAX_TOKENS
from tests.test_prompt_embeds import _assert_matches_hf as embeds_hf_check

BLOCK_SIZE = 4
MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts of 14 (3.5 blocks), 16 (4 whole blocks), 3 (under a block) and 22 tokens; the
    last shares its first 2 blocks with the first."""
    gen = torch.Generator().manual_seed(5)
    p14, p16, p3 = (torch.randint(2, vocab_size, (n,), generator=gen).tolist()
                    for n in (14, 16, 3))
    return [p14, p16, p3, p14[:8] + torch.randint(2, vocab_size, (14,), generator=gen).tolist()]


def _loaded_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def _kv(folder: str, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}


def _llm(path: str, folder: str | None, role: str = "kv_both", **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("dtype", "float32")
    return LLM(model=path,
               kv_transfer_config=None if folder is None else _kv(folder, role), **kwargs)


def _dense_tokens(llm: LLM) -> int:
    return llm.engine.core.executor.collective_rpc("step_stats")[0]["dense_tokens"]


def _hf_greedy(tiny, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _produce(path: str, folder: str, prompts: list[list[int]], **kwargs
             ) -> tuple[list[int], str]:
    """Prefill ``prompts`` on a producer; returns their ``num_cached_tokens`` and the
    producer's model key (for ``block_keys``)."""
    producer = _llm(path, folder, "kv_producer", **kwargs)
    try:
        outs = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL,
                                 use_tqdm=False)
        model_key = producer.engine.core.scheduler.connector.model_key
    finally:
        producer.shutdown()
    return [o.metrics.num_cached_tokens for o in outs], model_key


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _assert_same_logprobs(got, want) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for token, lg, lw in zip(w.outputs[0].token_ids, g.outputs[0].logprobs,
                                 w.outputs[0].logprobs):
            assert abs(lg[token].logprob - lw[token].logprob) < 1e-4


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """A plain engine's greedy outputs of the prompts (the logprob oracle)."""
    llm = _llm(tiny_llama.path, None)
    try:
        yield _generate(llm, _prompts(tiny_llama.vocab_size))
    finally:
        llm.shutdown()


def test_stored_blocks_are_transformers_kv(tiny_llama, tmp_path):
    """Every full prompt block is stored once (the 4th prompt's first 2 blocks are the 1st's),
    under the key of its tokens, and holds HF's keys (after RoPE) and values."""
    prompts = _prompts(tiny_llama.vocab_size)
    # a producer loads nothing: only its own prefix cache serves the 4th prompt's 2 blocks
    cached, model_key = _produce(tiny_llama.path, str(tmp_path), prompts)
    assert cached == [0, 0, 0, 8]
    keys = {k for p in prompts for k in block_keys(p, BLOCK_SIZE, "auto", model_key)}
    assert len(keys) == 3 + 4 + 0 + 5 - 2
    assert {os.path.basename(f) for f in glob.glob(f"{tmp_path}/*")} == \
        {f"{k}.safetensors" for k in keys}
    prompt = prompts[0]
    with torch.no_grad():
        cache = tiny_llama.hf_model(torch.tensor([prompt]), use_cache=True).past_key_values
    for i, key in enumerate(block_keys(prompt, BLOCK_SIZE, "auto", model_key)):
        stored = load_file(block_path(str(tmp_path), key))
        layers = sorted(stored, key=lambda n: int(re.search(r"\d+", n).group()))
        assert len(layers) == tiny_llama.hf_model.config.num_hidden_layers
        for layer, name in enumerate(layers):
            k, v = cache[layer] if isinstance(cache, tuple) else \
                (cache.layers[layer].keys, cache.layers[layer].values)
            want = torch.stack([k[0, :, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE].transpose(0, 1),
                                v[0, :, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE].transpose(0, 1)])
            torch.testing.assert_close(stored[name], want, atol=1e-5, rtol=1e-5)


@slow  # the TP=2 layout of this file's one-process cases: scripts/test_distributed_slow.sh
def test_tensor_parallel_ranks_store_and_load_their_heads(tiny_llama, tmp_path, plain,
                                                         assert_no_leaks):
    """TP=2 (two CPU worker processes): each rank stores its own KV heads' file of every
    block, which side by side are the TP=1 block; a repeat of the prompts (kv_both, no
    prefix caching) loads them on both ranks and decodes the TP=1 plain run's tokens and
    logprobs; a block one rank fails to load is recomputed on both."""
    prompts = _prompts(tiny_llama.vocab_size)
    _, model_key = _produce(tiny_llama.path, str(tmp_path / "tp1"), prompts[:1])
    llm = _llm(tiny_llama.path, str(tmp_path / "tp2"), enable_prefix_caching=False,
               tensor_parallel_size=2)
    try:
        first = _generate(llm, prompts)
        again = _generate(llm, prompts)
        assert llm.engine.core.scheduler.connector.model_key == model_key
        assert [o.metrics.num_cached_tokens for o in first] == [0] * len(prompts)
        assert [o.metrics.num_cached_tokens for o in again] == \
            [_loaded_tokens(p) for p in prompts]
        _assert_same_logprobs(first, plain)
        _assert_same_logprobs(again, plain)
        # rank 1's file of block 1 gone after the lookup: rank 0 learns it too, the request
        # is recomputed from block 1 on both ranks
        keys = block_keys(prompts[0], BLOCK_SIZE, "auto", model_key)
        _spoil_after_lookup(llm, block_path(str(tmp_path / "tp2"), keys[1], 1, 2), os.remove)
        third = _generate(llm, prompts[:1])
        assert third[0].metrics.num_cached_tokens == BLOCK_SIZE
        _assert_same_logprobs(third, plain[:1])
        assert_no_leaks(llm)
    finally:
        llm.shutdown()
    assert not os.path.exists(block_path(str(tmp_path / "tp2"), keys[0]))  # only rank files
    for key in keys[:1] + keys[2:]:  # block 1's rank-1 file was deleted
        whole = load_file(block_path(str(tmp_path / "tp1"), key))
        shards = [load_file(block_path(str(tmp_path / "tp2"), key, rank, 2))
                  for rank in range(2)]
        assert set(shards[0]) == set(shards[1]) == set(whole)
        for name, tensor in whole.items():  # [2, block_size, kv_heads, head_dim]
            assert shards[0][name].shape[2] == tensor.shape[2] // 2
            torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=2), tensor,
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix_caching, backend", [
    (True, "uni"), (False, "uni"), pytest.param(True, "mp", marks=SLOW)])
def test_consumer_loads_and_computes_the_tail(tiny_llama, tmp_path, plain, prefix_caching,
                                              backend, assert_no_leaks):
    """A fresh consumer (its worker in the engine's process, or in a process of its own:
    the loads cross the step message) loads each prompt's whole blocks but the last
    token's. The ``mp`` case runs in scripts/test_distributed_slow.sh, as does its TP=2
    sibling test_tensor_parallel_ranks_store_and_load_their_heads (the loads cross the step
    message, kvflow/executor/step_codec.py, to the worker processes)."""
    prompts = _prompts(tiny_llama.vocab_size)
    _produce(tiny_llama.path, str(tmp_path), prompts)
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer",
                    enable_prefix_caching=prefix_caching, distributed_executor_backend=backend)
    try:
        outs = _generate(consumer, prompts)
        loaded = [_loaded_tokens(p) for p in prompts]
        assert [o.metrics.num_cached_tokens for o in outs] == loaded  # 12, 12, 0, 20
        # only the tail of each prompt and the decodes ran through the model
        assert _dense_tokens(consumer) == \
            sum(len(p) - n for p, n in zip(prompts, loaded)) + len(prompts) * (MAX_TOKENS - 1)
        assert [o.outputs[0].token_ids for o in outs] == \
            [_hf_greedy(tiny_llama, p) for p in prompts]
        _assert_same_logprobs(outs, plain)
        assert consumer.engine.core.scheduler.connector.num_saved_blocks == 0  # consumer only
        assert_no_leaks(consumer)
    finally:
        consumer.shutdown()


def test_kv_both_without_prefix_caching_reloads_its_own_blocks(tiny_llama, tmp_path, plain,
                                                              assert_no_leaks):
    """One kv_both engine without prefix caching: the first run stores the prompts, a repeat
    loads them back (and stores nothing new)."""
    prompts = _prompts(tiny_llama.vocab_size)
    llm = _llm(tiny_llama.path, str(tmp_path), enable_prefix_caching=False)
    try:
        first = _generate(llm, prompts)
        assert [o.metrics.num_cached_tokens for o in first] == [0] * len(prompts)
        connector = llm.engine.core.scheduler.connector
        assert connector.num_saved_blocks == 10
        again = _generate(llm, prompts)
        assert [o.metrics.num_cached_tokens for o in again] == \
            [_loaded_tokens(p) for p in prompts]
        assert connector.num_saved_blocks == 10
        _assert_same_logprobs(first, plain)
        _assert_same_logprobs(again, plain)
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_chunked_prefill_stores_and_loads_the_same_blocks(tiny_llama, tmp_path,
                                                          assert_no_leaks):
    """A producer prefilling in chunks of 6 tokens (blocks complete mid-chunk) stores the
    blocks an unchunked one stores; a chunked consumer loads them and chunks the tail."""
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(2, tiny_llama.vocab_size, (30,), generator=gen).tolist()
    _, model_key = _produce(tiny_llama.path, str(tmp_path / "chunked"), [prompt],
                            max_num_batched_tokens=6)
    _produce(tiny_llama.path, str(tmp_path / "whole"), [prompt])
    for key in block_keys(prompt, BLOCK_SIZE, "auto", model_key):
        chunked = load_file(block_path(str(tmp_path / "chunked"), key))
        whole = load_file(block_path(str(tmp_path / "whole"), key))
        for name in whole:
            torch.testing.assert_close(chunked[name], whole[name], atol=1e-5, rtol=1e-5)
    consumer = _llm(tiny_llama.path, str(tmp_path / "chunked"), "kv_consumer",
                    max_num_batched_tokens=6)
    try:
        (out,) = _generate(consumer, [prompt])
        assert out.metrics.num_cached_tokens == 28
        assert out.outputs[0].token_ids == _hf_greedy(tiny_llama, prompt)
        assert_no_leaks(consumer)
    finally:
        consumer.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_moves_its_scales(tiny_llama, tmp_path, kv_cache_dtype,
                                          assert_no_leaks):
    """A quantized cache stores each block's int8/fp8 K/V with its float32 scales; the
    consumer decodes what a plain engine with the same cache decodes."""
    prompts = _prompts(tiny_llama.vocab_size)
    try:
        _, model_key = _produce(tiny_llama.path, str(tmp_path), prompts,
                                kv_cache_dtype=kv_cache_dtype)
    except ValueError as e:
        pytest.skip(f"{kv_cache_dtype} KV cache not available here: {e}")
    key = block_keys(prompts[0], BLOCK_SIZE, kv_cache_dtype, model_key)[0]
    stored = load_file(block_path(str(tmp_path), key))
    scales = [n for n in stored if n.endswith(".kv_scales")]
    assert len(scales) == tiny_llama.hf_model.config.num_hidden_layers
    assert all(stored[n].dtype == torch.float32 and stored[n].abs().min() > 0 for n in scales)
    plain = _llm(tiny_llama.path, None, kv_cache_dtype=kv_cache_dtype)
    try:
        want = _generate(plain, prompts)
    finally:
        plain.shutdown()
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer", kv_cache_dtype=kv_cache_dtype)
    try:
        got = _generate(consumer, prompts)
        assert [o.metrics.num_cached_tokens for o in got] == [_loaded_tokens(p) for p in prompts]
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert_no_leaks(consumer)
    finally:
        consumer.shutdown()


def test_preempted_consumer_requests_leak_nothing(tiny_llama, tmp_path, assert_no_leaks):
    """A consumer pool too small for every request at once preempts (recompute); readmitted
    requests load their blocks again into new ones (once per admission), outputs stay HF's,
    every block comes back."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, tiny_llama.vocab_size, (13,), generator=gen).tolist()
               for _ in range(6)]
    _produce(tiny_llama.path, str(tmp_path), prompts)
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer", num_kv_blocks=16,
                    enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        outs = consumer.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        preemptions = consumer.engine.core.scheduler.num_preemptions
        assert preemptions > 0
        # each admission (first or after a preemption) loads the prompt's 3 blocks once
        assert consumer.engine.core.scheduler.connector.num_loaded_blocks == \
            3 * (len(prompts) + preemptions)
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                hf = tiny_llama.hf_model.generate(torch.tensor([p]), do_sample=False,
                                                  max_new_tokens=12, min_new_tokens=12,
                                                  eos_token_id=None, pad_token_id=0)
            assert o.outputs[0].token_ids == hf[0, len(p):].tolist()
            assert o.metrics.num_cached_tokens == 12
        assert_no_leaks(consumer)
    finally:
        consumer.shutdown()


def test_ngram_speculative_decoding_on_both_sides(tiny_llama, tmp_path, assert_no_leaks):
    """n-gram speculative decoding (drafts from the tokens alone, no draft KV) on the producer
    and on the consumer, with and without prefix caching: the consumer loads each prompt's
    whole blocks but the last token's, its drafts are verified (some accepted: the prompts
    repeat), and its greedy tokens are a plain engine's (no connector, no drafts)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1, "adaptive": False}  # drafts on every step
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(2, tiny_llama.vocab_size, (6,), generator=gen).tolist()
    prompts = [base * 4, base * 3 + base[:3], *_prompts(tiny_llama.vocab_size)[:2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _llm(tiny_llama.path, None)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        plain.shutdown()
    _produce(tiny_llama.path, str(tmp_path), prompts, speculative_config=ngram)
    for prefix_caching in (True, False):
        consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer",
                        speculative_config=ngram, enable_prefix_caching=prefix_caching)
        try:
            outs = consumer.generate([{"prompt_token_ids": p} for p in prompts], params,
                                     use_tqdm=False)
            assert [o.metrics.num_cached_tokens for o in outs] == \
                [_loaded_tokens(p) for p in prompts]  # 20, 20, 12, 12
            assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
            assert [o.outputs[0].token_ids for o in outs] == want
            assert_no_leaks(consumer)
        finally:
            consumer.shutdown()


def test_prompt_logprobs_prefills_store_their_blocks(tiny_llama, tmp_path, plain):
    """A producer's prefill asking for prompt logprobs (a proxy's ``max_tokens=1`` request)
    computes every prompt block like any other: it stores them (it stored them only when it
    decoded a step after its prefill), and a consumer's request without prompt logprobs
    loads them and decodes the plain run's tokens and logprobs."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    producer = _llm(tiny_llama.path, str(tmp_path), "kv_producer")
    try:
        producer.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        producer.shutdown()
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
    try:
        outs = _generate(consumer, [prompt])
    finally:
        consumer.shutdown()
    assert outs[0].metrics.num_cached_tokens == _loaded_tokens(prompt)
    _assert_same_logprobs(outs, plain[:1])


def test_prompt_logprobs_requests_compute_their_prompt(tiny_llama, tmp_path):
    """A request asking for prompt logprobs needs every prompt token computed: it loads
    nothing, and its prompt logprobs are HF's log-softmax."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    _produce(tiny_llama.path, str(tmp_path), [prompt])
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
    try:
        (out,) = consumer.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        consumer.shutdown()
    assert out.metrics.num_cached_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0], -1)
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    torch.testing.assert_close(torch.tensor(got), ref[torch.arange(len(prompt) - 1),
                                                      torch.tensor(prompt[1:])],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("other", ["same_shapes", "qwen3"])
def test_another_model_loads_nothing(tiny_llama, tiny_tokenizer, tiny_model_factory, tmp_path,
                                     other):
    """A folder written by another model, of the same shapes and config but other weights,
    or of other shapes: a consumer of that model finds none of the blocks (its keys name
    its own weights) and decodes what transformers decodes with its own weights."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    _produce(tiny_llama.path, str(tmp_path / "kv"), [prompt])
    model = build_tiny_model("llama", str(tmp_path / "model"), tiny_tokenizer, seed=99) \
        if other == "same_shapes" else tiny_model_factory(other)
    if other == "same_shapes":  # the same config and file sizes, only the weights differ
        with open(f"{tiny_llama.path}/config.json") as a, open(f"{model.path}/config.json") as b:
            assert json.load(a) == json.load(b)
        assert os.path.getsize(f"{tiny_llama.path}/model.safetensors") == \
            os.path.getsize(f"{model.path}/model.safetensors")
    consumer = _llm(model.path, str(tmp_path / "kv"), "kv_consumer")
    try:
        (out,) = _generate(consumer, [prompt])
    finally:
        consumer.shutdown()
    assert out.metrics.num_cached_tokens == 0
    assert out.outputs[0].token_ids == _hf_greedy(model, prompt)


@pytest.mark.parametrize("producer_kwargs, layout", [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype=int8"),
    ({"block_size": 8}, "block_size=8,"),
    ({"dtype": "bfloat16"}, "dtype=bfloat16,"),
])
def test_a_consumer_of_another_layout_is_refused_or_warned(tiny_llama, tmp_path, caplog,
                                                         producer_kwargs, layout):
    """A producer of another KV-cache dtype, block size or compute dtype stores blocks a
    consumer can never load (other keys): a consumer started on its folder is refused naming both layouts; one
    started before that producer computes the prompt (HF's tokens) and warns once; a
    consumer of the producer's own layout, or a folder that also has its own layout, starts."""
    prompt, other = _prompts(tiny_llama.vocab_size)[:2]
    early = _llm(tiny_llama.path, str(tmp_path), "kv_consumer")  # before any producer
    try:
        _produce(tiny_llama.path, str(tmp_path), [prompt], **producer_kwargs)
        with pytest.raises(ValueError, match=rf"store KV blocks of .*{layout}.*this engine's "
                                             r"KV cache is dtype=float32,block_size=4,"
                                             r"kv_cache_dtype=auto,tensor_parallel_size=1,"):
            _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
        with caplog.at_level("WARNING", "kvflow.distributed.kv_transfer.shared_storage"):
            outs = _generate(early, [prompt, other])
        assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]
        assert outs[0].outputs[0].token_ids == _hf_greedy(tiny_llama, prompt)
        warnings = [r.getMessage() for r in caplog.records if "store KV blocks of" in r.message]
        assert len(warnings) == 1 and layout in warnings[0], warnings
    finally:
        early.shutdown()
    _llm(tiny_llama.path, str(tmp_path), "kv_consumer", **producer_kwargs).shutdown()
    _produce(tiny_llama.path, str(tmp_path), [prompt])  # this layout's producer too
    _llm(tiny_llama.path, str(tmp_path), "kv_consumer").shutdown()


def test_a_checkpoint_differing_only_mid_file_has_another_identity(tmp_path):
    """Two checkpoints of one config whose weight files differ only in a tensor between
    their first and last MiB (a fine-tune that leaves the embeddings and the last tensor
    alone): other model identities, so neither loads the other's blocks; a copy of one
    matches it."""
    from types import SimpleNamespace

    from kvflow.distributed.kv_transfer.storage_keys import model_identity

    gen = torch.Generator().manual_seed(0)
    head, tail = (torch.randn(3 << 18, generator=gen) for _ in range(2))  # 3 MiB each
    middle = torch.randn(1 << 18, generator=gen)  # 1 MiB
    config = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "hidden_size": 8})
    model_config = SimpleNamespace(load_format="auto", quantization=None,
                                   quantization_group_size=None, seed=0)
    identities = []
    for name, mid in (("base", middle), ("copy", middle.clone()), ("tuned", middle + 0.01)):
        os.makedirs(tmp_path / name)
        save_file({"a.head": head, "b.middle": mid, "c.tail": tail},
                  str(tmp_path / name / "model.safetensors"))
        identities.append(model_identity(str(tmp_path / name), config, torch.float32,
                                         model_config))
    base, copy, tuned = identities
    assert base == copy != tuned


def test_reloaded_weights_neither_load_nor_overwrite_the_old_blocks(tiny_llama, tmp_path,
                                                                    assert_no_leaks):
    """``reload_weights`` after the checkpoint's keys and values changed (a kv_both engine
    without prefix caching, so only the connector serves a repeat): the repeat loads none of
    the blocks the old weights stored (they were loaded, and the tokens were the old
    model's) and decodes what transformers decodes with the new files; it stores its own,
    which the next repeat loads."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama.path, folder)
    prompts = _prompts(tiny_llama.vocab_size)
    llm = _llm(str(folder), str(tmp_path / "kv"), enable_prefix_caching=False)
    try:
        first = _generate(llm, prompts)
        assert [o.metrics.num_cached_tokens for o in first] == [0] * len(prompts)
        (path,) = folder.glob("*.safetensors")
        weights = load_file(path)
        gen = torch.Generator().manual_seed(0)
        for name, w in weights.items():  # every layer's keys and values: new K/V everywhere
            if "k_proj" in name or "v_proj" in name:
                weights[name] = torch.randn(w.shape, generator=gen, dtype=w.dtype) * 0.5
        save_file(weights, str(path), metadata={"format": "pt"})
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                min_new_tokens=MAX_TOKENS, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        assert [o.outputs[0].token_ids for o in first] != want
        assert llm.collective_rpc("reload_weights") == [None]
        again = _generate(llm, prompts)
        assert [o.metrics.num_cached_tokens for o in again] == [0] * len(prompts)
        assert [o.outputs[0].token_ids for o in again] == want
        third = _generate(llm, prompts)
        assert [o.metrics.num_cached_tokens for o in third] == \
            [_loaded_tokens(p) for p in prompts]
        assert [o.outputs[0].token_ids for o in third] == want
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_salted_requests_load_only_their_salts_blocks(tiny_llama, tmp_path, plain):
    """``cache_salt`` keys every block: the salted prefill is found by the same salt only;
    the unsalted and other-salt requests compute their prompt."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    producer = _llm(tiny_llama.path, str(tmp_path), "kv_producer")
    try:
        producer.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, PREFILL,
                          use_tqdm=False)
    finally:
        producer.shutdown()
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer", enable_prefix_caching=False)
    try:
        outs = consumer.generate([{"prompt_token_ids": prompt, "cache_salt": salt}
                                  for salt in ("alice", "bob")]
                                 + [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    finally:
        consumer.shutdown()
    assert [o.metrics.num_cached_tokens for o in outs] == [_loaded_tokens(prompt), 0, 0]
    _assert_same_logprobs(outs, [plain[0]] * 3)


def test_lora_requests_load_their_adapters_blocks(tiny_llama, tmp_path):
    """A LoRA request's blocks are keyed by its adapter: a consumer loads them for the same
    adapter (greedy tokens equal peft's), and neither the base model nor another adapter
    finds them."""
    make = lambda name, seed: make_adapter(
        tiny_llama.path, str(tmp_path / name), seed, r=8, lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapters = {"a": make("a", 1), "b": make("b", 2)}
    lora = {name: LoRARequest(name, i + 1, path) for i, (name, path) in
            enumerate(adapters.items())}
    prompt = _prompts(tiny_llama.vocab_size)[0]
    kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    producer = _llm(tiny_llama.path, str(tmp_path / "kv"), "kv_producer", **kwargs)
    try:
        producer.generate({"prompt_token_ids": prompt}, PREFILL, lora_request=lora["a"],
                          use_tqdm=False)
    finally:
        producer.shutdown()
    consumer = _llm(tiny_llama.path, str(tmp_path / "kv"), "kv_consumer",
                    enable_prefix_caching=False, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=LORA_MAX_TOKENS, ignore_eos=True)
    try:
        outs = consumer.generate([{"prompt_token_ids": prompt}] * 3, params,
                                 lora_request=[lora["a"], lora["b"], None], use_tqdm=False)
    finally:
        consumer.shutdown()
    assert [o.metrics.num_cached_tokens for o in outs] == [_loaded_tokens(prompt), 0, 0]
    for out, adapter in zip(outs, [adapters["a"], adapters["b"], None]):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, adapter, prompt)


def test_prompt_embeds_requests_load_their_embeddings_blocks(tiny_llama, tmp_path):
    """A prompt given as embeddings: its blocks are keyed by the embeddings' digest, so the
    same embeddings load them (outputs equal transformers' ``inputs_embeds`` run and a plain
    engine's logprobs) and other embeddings of the same length load nothing."""
    gen = torch.Generator().manual_seed(11)
    embeds = [0.5 * torch.randn(14, 64, generator=gen) for _ in range(2)]
    prompts = [{"prompt_embeds": e} for e in embeds]
    producer = _llm(tiny_llama.path, str(tmp_path), "kv_producer", enable_prompt_embeds=True)
    try:
        producer.generate(prompts[:1], PREFILL, use_tqdm=False)
    finally:
        producer.shutdown()
    params = SamplingParams(temperature=0, max_tokens=EMBEDS_MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    plain_llm = _llm(tiny_llama.path, None, enable_prompt_embeds=True)
    try:
        want = plain_llm.generate(prompts, params, use_tqdm=False)
    finally:
        plain_llm.shutdown()
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer", enable_prompt_embeds=True)
    try:
        outs = consumer.generate(prompts, params, use_tqdm=False)
    finally:
        consumer.shutdown()
    assert [o.metrics.num_cached_tokens for o in outs] == [12, 0]
    _assert_same_logprobs(outs, want)
    for out, e in zip(outs, embeds):
        embeds_hf_check(tiny_llama, e, out.outputs[0].token_ids)


def _spoil_after_lookup(llm: LLM, path: str, spoil) -> None:
    """Run ``spoil(path)`` once, right after the step that first plans a load is scheduled
    (the lookup found the file; the worker has not read it yet)."""
    connector = llm.engine.core.scheduler.connector
    build = connector.build_connector_meta
    done = []

    def build_then_spoil(*args):
        meta = build(*args)
        if meta.loads and not done:
            spoil(path)
            done.append(path)
        return meta

    connector.build_connector_meta = build_then_spoil


def _corrupt(path: str) -> None:
    with open(path, "r+b") as f:  # its safetensors header
        f.write(b"\xff" * 64)


@pytest.mark.parametrize("spoil", ["delete", "corrupt"])
def test_block_gone_after_lookup_is_recomputed(tiny_llama, tmp_path, plain, spoil,
                                               assert_no_leaks):
    """A stored block deleted (or overwritten with garbage) between the lookup and the load:
    with the default ``kv_load_failure_policy`` its request, and the one holding it through a
    prefix-cache hit (the 4th prompt shares the 1st's first 2 blocks), are recomputed from it.
    At readmission the 1st finds its block 0 only; the 4th hits the 1st's blocks 0 and 1 (now
    computed) and loads its own 3 later blocks, still good. Every output is the plain run's."""
    prompts = _prompts(tiny_llama.vocab_size)
    _, model_key = _produce(tiny_llama.path, str(tmp_path), prompts)
    bad = block_path(str(tmp_path), block_keys(prompts[0], BLOCK_SIZE, "auto", model_key)[1])
    consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
    if spoil == "delete":
        _spoil_after_lookup(consumer, bad, os.remove)
    else:
        _spoil_after_lookup(consumer, bad, _corrupt)
    try:
        outs = _generate(consumer, prompts)
        assert [o.metrics.num_cached_tokens for o in outs] == \
            [BLOCK_SIZE, _loaded_tokens(prompts[1]), 0, _loaded_tokens(prompts[3])]
        # the 4th was sent back too: it loaded (or hit) its first 2 blocks twice
        assert consumer.engine.core.scheduler.connector.num_loaded_blocks == 3 + 3 + 3 + 3
        _assert_same_logprobs(outs, plain)
        assert_no_leaks(consumer)
        consumer.reset_prefix_cache()  # storage only: a corrupt file is not offered again
        again = _generate(consumer, prompts[:1])
        assert again[0].metrics.num_cached_tokens == BLOCK_SIZE
        assert consumer.engine.core.scheduler.connector.num_loaded_blocks == 12 + 1
        _assert_same_logprobs(again, plain[:1])
    finally:
        consumer.shutdown()


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("spoil", [_truncate, _corrupt], ids=["truncated", "garbage"])
def test_a_file_that_fails_to_load_is_rewritten_by_the_recompute(tiny_llama, tmp_path, plain,
                                                                 spoil, assert_no_leaks):
    """A stored block's file truncated (or its header garbage) before a fresh kv_both engine
    starts: its load fails, the request computes it from there, and the computed K/V replace
    the file (atomically), which then equals a clean producer's, so the next fresh consumer
    loads every block (hand count: 12 tokens) with the plain run's tokens and logprobs."""
    first = _prompts(tiny_llama.vocab_size)[0]
    folder, clean = tmp_path / "kv", tmp_path / "clean"
    _, model_key = _produce(tiny_llama.path, str(folder), [first])
    _produce(tiny_llama.path, str(clean), [first])
    bad = block_path(str(folder), block_keys(first, BLOCK_SIZE, "auto", model_key)[1])
    spoil(bad)
    llm = _llm(tiny_llama.path, str(folder))
    try:
        outs = _generate(llm, [first])
        assert outs[0].metrics.num_cached_tokens == BLOCK_SIZE  # block 0 only, then computed
        _assert_same_logprobs(outs, plain[:1])
        assert_no_leaks(llm)
    finally:
        llm.shutdown()
    assert not glob.glob(f"{folder}/*.tmp") and not glob.glob(f"{folder}/.kvflow-tmp/*")
    got, want = load_file(bad), load_file(str(clean / os.path.basename(bad)))
    assert got.keys() == want.keys()
    for tensor in want:
        torch.testing.assert_close(got[tensor], want[tensor], atol=1e-5, rtol=1e-5)
    consumer = _llm(tiny_llama.path, str(folder), "kv_consumer")
    try:
        again = _generate(consumer, [first])
        assert again[0].metrics.num_cached_tokens == _loaded_tokens(first)
        _assert_same_logprobs(again, plain[:1])
    finally:
        consumer.shutdown()


def test_kv_computed_over_a_block_not_loaded_is_not_stored(tiny_llama, tmp_path, plain,
                                                          assert_no_leaks):
    """A kv_both engine loads the 1st prompt's stored blocks 0 and 1 (a producer stored only
    those) and block 1 is deleted after the lookup: the step computes the 1st prompt's block
    2, and the 4th prompt's blocks 2 to 4 (it hits the 1st's blocks 0 and 1 in that step),
    over whatever block 1 held. Those K/V must not be stored: once the recompute has stored
    everything, the folder holds what a clean producer stores (file by file), and a fresh
    consumer loading all of it decodes the plain run's tokens and logprobs."""
    prompts = _prompts(tiny_llama.vocab_size)
    first, fourth = prompts[0], prompts[3]
    folder, clean = tmp_path / "kv", tmp_path / "clean"
    _, model_key = _produce(tiny_llama.path, str(folder), [first[:9]])  # blocks 0 and 1
    _produce(tiny_llama.path, str(clean), [first, fourth])
    keys = block_keys(first, BLOCK_SIZE, "auto", model_key)
    llm = _llm(tiny_llama.path, str(folder))
    _spoil_after_lookup(llm, block_path(str(folder), keys[1]), os.remove)
    try:
        outs = _generate(llm, [first, fourth])
        _assert_same_logprobs(outs, [plain[0], plain[3]])
        assert_no_leaks(llm)
    finally:
        llm.shutdown()
    names = {os.path.basename(f) for f in glob.glob(f"{clean}/*")}
    assert {os.path.basename(f) for f in glob.glob(f"{folder}/*")} == names
    assert len(names) == 3 + 5 - 2
    for name in names:
        got, want = load_file(f"{folder}/{name}"), load_file(f"{clean}/{name}")
        for tensor in want:
            torch.testing.assert_close(got[tensor], want[tensor], atol=1e-5, rtol=1e-5)
    consumer = _llm(tiny_llama.path, str(folder), "kv_consumer")
    try:
        again = _generate(consumer, [first, fourth])
        assert [o.metrics.num_cached_tokens for o in again] == \
            [_loaded_tokens(first), _loaded_tokens(fourth)]
        _assert_same_logprobs(again, [plain[0], plain[3]])
    finally:
        consumer.shutdown()


def test_fail_policy_fails_the_step(tiny_llama, tmp_path):
    """``kv_load_failure_policy="fail"``: a block deleted after the lookup fails the step,
    naming the block."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    _, model_key = _produce(tiny_llama.path, str(tmp_path), [prompt])
    key = block_keys(prompt, BLOCK_SIZE, "auto", model_key)[1]
    consumer = LLM(model=tiny_llama.path, dtype="float32", block_size=BLOCK_SIZE,
                   num_kv_blocks=64, kv_transfer_config={
                       **_kv(str(tmp_path), "kv_consumer"), "kv_load_failure_policy": "fail"})
    _spoil_after_lookup(consumer, block_path(str(tmp_path), key), os.remove)
    try:
        with pytest.raises(ValueError, match=f"block {key} .* before it was loaded"):
            consumer.generate({"prompt_token_ids": prompt}, PREFILL, use_tqdm=False)
    finally:
        consumer.shutdown()


@pytest.mark.parametrize("value, needle", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "'NixlConnector' is not available"),
    ({"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}, "P2pNcclConnector"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "LMCacheConnectorV1"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both"}, "MultiConnector"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, "OffloadingConnector"),
    ({"kv_connector": "Nope", "kv_role": "kv_both"}, "kv_connector='Nope' is unknown"),
    ({"kv_role": "kv_both"}, "kv_connector=None"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
      "kv_load_failure_policy": "retry"}, "kv_load_failure_policy='retry'"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_prefill"}, "kv_role='kv_prefill'"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_port": 1},
     r"unknown or unsupported key\(s\) \['kv_port'\]"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shared_storage_path": "/tmp/x", "size": 1}},
     r"unknown key\(s\) \['size'\]"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shared_storage_path": ""}}, "shared_storage_path=''"),
    ("{not json", "kv_transfer_config is not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_config_is_refused(value, needle):
    with pytest.raises(ValueError, match=needle):
        KVTransferConfig.from_value(value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"context_parallel_size": 2}, "context_parallel_size=2"),
    ({"async_scheduling": True}, "async_scheduling"),
    ({"preemption_mode": "swap"}, "preemption_mode='swap'"),
    ({"speculative_config": {"method": "draft_model", "model": "d",
                             "num_speculative_tokens": 2}},
     "speculative_config method='draft_model' is not available: the connector moves the "
     + "target model's KV, not the draft's"),
])
def test_unsupported_settings_are_refused(kwargs, needle, tmp_path):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_kwargs(model="x", kv_transfer_config=_kv(str(tmp_path), "kv_both"),
                                 **kwargs)


def test_cli_flag_parses(tmp_path):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--kv-transfer-config",
                              json.dumps(_kv(str(tmp_path), "kv_consumer"))])
    kt = EngineConfig.from_cli_args(args).kv_transfer_config
    assert (kt.kv_role, kt.shared_storage_path, kt.is_producer, kt.is_consumer) == \
        ("kv_consumer", str(tmp_path), False, True)


@pytest.mark.parametrize("model, spec", [("mistral_sliding_window", "SlidingWindowSpec"),
                                         ("deepseek_v2", "MLAAttentionSpec")])
def test_sliding_window_and_mla_models_are_refused(tiny_model_factory, tmp_path, model, spec):
    with pytest.raises(ValueError, match=f"kv_transfer_config needs .*{spec}"):
        _llm(tiny_model_factory(model).path, str(tmp_path))


def test_folder_that_cannot_be_created_is_refused_naming_it(tmp_path):
    """A shared_storage_path under a regular file (as under a read-only mount) fails start-up
    with a ValueError naming the setting, not a bare OSError from the engine core."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = KVTransferConfig.from_value(_kv(str(blocker / "kv"), "kv_both"))
    with pytest.raises(ValueError, match=r"shared_storage_path='.*file/kv' cannot be created"):
        SharedStorageScheduler(config, BLOCK_SIZE, "auto")
    with pytest.raises(ValueError, match="shared_storage_path=.*cannot be created"):
        SharedStorageWorker(config, BLOCK_SIZE, "auto", dict)
    assert not os.path.exists(blocker / "kv")


def test_two_writers_of_one_block_in_one_process_both_succeed(tmp_path, monkeypatch):
    """Two engines (or two containers whose processes share a pid) saving the same block at
    once: each writes its own temporary file, so the slower one's rename still finds its file
    and the block holds the K/V both computed. Oracle: the tensors written, by hand."""
    import kvflow.distributed.kv_transfer.storage_worker as ss
    from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata

    kv = torch.arange(2 * 3 * BLOCK_SIZE * 2 * 8, dtype=torch.float32).reshape(2, 3, BLOCK_SIZE,
                                                                                2, 8)
    config = KVTransferConfig.from_value(_kv(str(tmp_path), "kv_both"))
    first, second = (SharedStorageWorker(config, BLOCK_SIZE, "auto",
                                         lambda: {"layer.0": (kv, None)}) for _ in range(2))
    key = block_keys(list(range(BLOCK_SIZE)), BLOCK_SIZE, "auto")[0]
    meta = KVConnectorMetadata(saves=[BlockTransfer("r", [1], [key])])
    real_save, calls = ss.save_file, []

    def interleaved_save(tensors, filename):  # the second writer runs inside the first's write
        real_save(tensors, filename)
        calls.append(filename)
        if len(calls) == 1:
            second.wait_for_save(meta)

    monkeypatch.setattr(ss, "save_file", interleaved_save)
    first.wait_for_save(meta)
    assert len(calls) == 2 and calls[0] != calls[1]
    torch.testing.assert_close(load_file(block_path(str(tmp_path), key))["layer.0.kv"],
                               kv[:, 1], rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == [".kvflow-tmp", f"{key}.safetensors"]
    assert os.listdir(tmp_path / ".kvflow-tmp") == []  # no temporary file left


def test_a_save_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A block whose file cannot be written (a full disk: the writer wrote part of it, then
    raised) fails the save with the OS error, as vLLM's does, and leaves nothing in the
    folder: no partial temporary file piles up with each failed step."""
    import kvflow.distributed.kv_transfer.storage_worker as ss
    from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata

    kv = torch.zeros(2, 2, BLOCK_SIZE, 2, 8)
    worker = SharedStorageWorker(KVTransferConfig.from_value(_kv(str(tmp_path), "kv_both")),
                                 BLOCK_SIZE, "auto", lambda: {"layer.0": (kv, None)})
    key = block_keys(list(range(BLOCK_SIZE)), BLOCK_SIZE, "auto")[0]

    def disk_full(tensors, filename):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ss, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        worker.wait_for_save(KVConnectorMetadata(saves=[BlockTransfer("r", [1], [key])]))
    assert os.listdir(tmp_path) == [".kvflow-tmp"]
    assert os.listdir(tmp_path / ".kvflow-tmp") == []
