"""``--kv-cache-dtype int8|fp8_e4m3`` end to end: the pool holds as many more blocks as the
page size (values + per-token-per-head float32 scales) shrinks, and the engine's logprobs equal
transformers' with a KV cache that rounds every key/value row the same way (a DynamicCache
whose ``update`` quantizes and dequantizes; the rule is written out in the test: INT8 keys
are rotated by the orthonormal Hadamard matrix first, scipy's construction, and back)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.linalg import hadamard

from kvflow import LLM, SamplingParams
from kvflow.kv_cache_interface import FullAttentionSpec, kv_cache_dtypes

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def round_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """Each row of the last dim through the cache: absmax/QMAX scale, int8 round-half-even or
    float8 e4m3, back to float."""
    s = (x.abs().amax(dim=-1, keepdim=True) / QMAX[name]).clamp(min=1e-38)
    y = x / s
    y = torch.round(y).clamp(-127, 127) if name == "int8" else y.to(torch.float8_e4m3fn).float()
    return y * s


def round_keys(x: torch.Tensor, name: str) -> torch.Tensor:
    """Key rows through the cache: INT8 rows rotated by H (orthonormal Hadamard of the row
    length), rounded, rotated back (the engine keeps scores ``(q H).(k H) = q.k``); FP8 as
    values."""
    if name != "int8":
        return round_rows(x, name)
    h = torch.from_numpy(hadamard(x.shape[-1])).to(x.dtype) / math.sqrt(x.shape[-1])
    return round_rows(x @ h, name) @ h.T


def test_page_size_counts_the_scales():
    auto = FullAttentionSpec(16, 2, 64, *kv_cache_dtypes("auto", torch.bfloat16))
    int8 = FullAttentionSpec(16, 2, 64, *kv_cache_dtypes("int8", torch.bfloat16))
    fp8 = FullAttentionSpec(16, 2, 64, *kv_cache_dtypes("fp8_e4m3", torch.bfloat16))
    assert auto.page_size_bytes == 2 * 16 * 2 * 64 * 2 == 8192
    assert int8.page_size_bytes == fp8.page_size_bytes == 2 * 16 * 2 * (64 + 4) == 4352
    assert auto.page_size_bytes / int8.page_size_bytes == pytest.approx(1.88, abs=0.01)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtypes("int4", torch.bfloat16)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_same_memory_holds_more_blocks(tiny_model_factory, name):
    tiny = tiny_model_factory("llama")
    blocks = {}
    for dtype in ("auto", name):
        llm = LLM(model=tiny.path, dtype="float32", kv_cache_memory="1MiB", block_size=8,
                  kv_cache_dtype=dtype)
        blocks[dtype] = llm.engine.core.kv_cache_config.num_blocks
        assert llm.engine.core.kv_bytes_per_token == 2 * 2 * 2 * (
            16 * 4 if dtype == "auto" else 16 + 4)  # layers x K/V x heads x bytes per head
    # fp32 head_dim 16: 64 bytes per row against 16 + 4 -> 3.2x the blocks
    assert blocks[name] / blocks["auto"] == pytest.approx(3.2, rel=0.01)


def _hf_logprobs_with_rounding_cache(tiny, ids: list[int], name: str) -> torch.Tensor:
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(round_keys(key_states, name), round_rows(value_states, name),
                                  layer_idx, *args, **kwargs)

    with torch.no_grad():
        out = tiny.hf_model(torch.tensor([ids]), past_key_values=RoundingCache(),
                            use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_matches_hf_with_a_rounding_cache(tiny_model_factory, name, backend):
    _check_against_rounding_cache(tiny_model_factory("llama"), name, backend, name)


def test_vllm_fp8_name_is_an_e4m3_cache(tiny_model_factory):
    """``--kv-cache-dtype fp8``, vLLM's spelling (FP8 E4M3 on CUDA), is an ``fp8_e4m3`` cache:
    logprobs equal transformers' with an e4m3-rounding cache (it was refused as invalid)."""
    llm = _check_against_rounding_cache(tiny_model_factory("llama"), "fp8", "cpu", "fp8_e4m3")
    assert llm.engine.config.cache_config.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("model", ["mistral_sliding_window", "qwen2_layer_types", "gemma2",
                                   "gemma3", "llama_mqa"])
def test_attention_variants_match_hf_with_a_rounding_cache(tiny_model_factory, model, backend,
                                                           name):
    """The quantized cache under every attention shape the tiny models give: a window of 8
    on every layer (its blocks freed), a full and a sliding group sharing tensors and scales,
    Gemma 2's soft-capped scores, Gemma 3's q/k norms and query_pre_attn_scalar, one KV head
    read by four query heads; 13-token prompts, so the window slides within the prompt.
    (Seed 9: under seed 8's prompt one INT8 value row of the sliding model holds -66.50002,
    within float32 noise of a rounding midpoint, which the engine and the oracle round to
    different levels: 5e-4 apart until the window slides past that token.)"""
    _check_against_rounding_cache(tiny_model_factory(model), name, backend, name, seed=9)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_prefix_hits_and_ngram_drafts_match_hf_with_a_rounding_cache(tiny_model_factory, name):
    """Cached blocks are read back with their scales (a second prompt hits the first's 3 full
    blocks) and n-gram drafts are verified over the quantized cache (several query tokens per
    decode row): every output keeps transformers' rounding-cache logprobs."""
    tiny = tiny_model_factory("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    llm = LLM(model=tiny.path, dtype="float32", kv_cache_dtype=name, num_kv_blocks=64,
              block_size=4, speculative_config=spec)
    loop = [11, 12, 13, 14] * 4  # the n-gram proposer drafts from its repeats
    prompts = [loop + [21, 22, 23], loop[:12] + [31, 32, 33, 34, 35]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 12]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        _assert_rounding_cache_logprobs(tiny, prompt, out.outputs[0], name)


def _assert_rounding_cache_logprobs(tiny, prompt: list[int], completion, name: str) -> None:
    """``completion`` (a greedy CompletionOutput with ``logprobs=1``) has transformers'
    tokens and logprobs (within 2e-4) under a cache rounding every row as ``name``, up to a
    near-tie of the reference; and the rounding is visible (the unrounded model differs)."""
    ids = prompt + completion.token_ids[:-1]
    ref = _hf_logprobs_with_rounding_cache(tiny, ids, name)[len(prompt) - 1:]
    for step, token in enumerate(completion.token_ids):
        if token != int(ref[step].argmax()):
            top2 = ref[step].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"step {step}: not a near-tie"
            break
        assert completion.logprobs[step][token].logprob == \
            pytest.approx(float(ref[step, token]), abs=2e-4)
    with torch.no_grad():
        plain = torch.log_softmax(tiny.hf_model(torch.tensor([ids])).logits[0], dim=-1)
    assert (plain[len(prompt) - 1:] - ref).abs().max() > 1e-3


def _check_against_rounding_cache(tiny, name: str, backend: str, rounding: str,
                                  seed: int = 8) -> LLM:
    """The engine with ``kv_cache_dtype=name`` decodes with transformers' logprobs under a
    cache rounding every row as ``rounding`` (a random prompt from ``seed``); returns the
    engine."""
    prompt = torch.randint(2, tiny.vocab_size, (13,),
                           generator=torch.Generator().manual_seed(seed))
    llm = LLM(model=tiny.path, dtype="float32", kv_cache_dtype=name, num_kv_blocks=64,
              block_size=4, attention_backend=backend, max_num_batched_tokens=8)
    runner = llm.engine.core.executor.runner
    # 'cpu': the native kernel reads it; without the native kernels (KVFLOW_NATIVE_CPU=0)
    # 'cpu' falls back to 'torch'
    from kvflow.kernels.cpu_native import native_cpu_kernels
    want = backend if native_cpu_kernels() is not None else "torch"
    assert runner.attn_ctx.backend.name == want
    # 8-token chunks: the prompt's second chunk and every decode read the quantized cache
    (out,) = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=6,
                                                            ignore_eos=True, logprobs=1),
                          use_tqdm=False)
    _assert_rounding_cache_logprobs(tiny, prompt.tolist(), out.outputs[0], rounding)
    layer = next(iter(runner.attn_layers.values()))
    assert layer.kv_cache.dtype == kv_cache_dtypes(rounding, torch.float32)[0]
    assert layer.kv_scales.shape == layer.kv_cache.shape[:4]
    return llm


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_preempted_requests_decode_as_unpreempted(tiny_model_factory, name, assert_no_leaks):
    """Six requests (two sharing a prompt prefix) in an 11-usable-block quantized pool are
    preempted and recomputed, their blocks (values and scales) reused by others and hit by
    prefix caching: greedy tokens equal a 255-block pool's, where nothing is preempted, and
    logprobs agree to 1e-3 (recomputed chunks round the same rows in other batches)."""
    tiny = tiny_model_factory("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, tiny.vocab_size, (int(n),), generator=gen).tolist()
               for n in (9, 14, 5, 11, 7, 12)]
    prompts[3] = prompts[1][:8] + prompts[3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(num_kv_blocks: int) -> tuple[LLM, list]:
        llm = LLM(model=tiny.path, dtype="float32", kv_cache_dtype=name, block_size=4,
                  num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16)
        return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    _, expected = run(256)
    llm, got = run(12)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        for step, token in enumerate(a.token_ids):
            assert a.logprobs[step][token].logprob == \
                pytest.approx(b.logprobs[step][token].logprob, abs=1e-3)
    assert_no_leaks(llm)
