"""Feature combinations against independent oracles (tiny random models, fp32, CPU).

Each feature has tests of its own; these run several at once: LoRA with chunked prefill and
prefix-cache hits (peft teacher forcing), prompt logprobs with hits and chunks (transformers),
INT8 KV with prefix caching, chunks and swap preemption, with and without a sliding window
(a plain int8 engine), n-gram
speculation with LoRA and seeded n>1 sampling (peft logprobs of the sampled tokens), a draft
model without the adapter for a target with it (peft's greedy tokens and logprobs), and
mean pooling of a prompt longer than one step's budget (a plain torch mean of HF states).
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import ALL_LINEAR, PROMPTS, make_adapter, peft_logprobs


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("combo_adapters")
    return make_adapter(tiny_llama.path, str(root / "all"), 1, r=8, lora_alpha=16,
                        target_modules=ALL_LINEAR)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def _check_against(ref: torch.Tensor, ids: list[int], out, atol: float = 1e-4) -> None:
    """``out``'s prompt logprobs and its sampled tokens' logprobs equal ``ref`` (log p of
    each next token under teacher forcing on ``ids`` + the sampled tokens)."""
    if out.prompt_logprobs is not None:
        got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
        assert got == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                    abs=atol)
    for sample in out.outputs:
        row0 = len(ids) - 1
        got = [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)]
        want = [ref[row0 + i, t].item() for i, t in enumerate(sample.token_ids)]
        assert got == pytest.approx(want, abs=atol)


def test_lora_chunked_prefill_and_prefix_hits_match_peft(tiny_llama, adapter,
                                                         assert_no_leaks):
    """A 5-token step budget (chunks that end mid-block), prefix caching on: a long prompt
    under the adapter and under the base model, then again (hits), then extended by a
    suffix (a partial hit). Greedy tokens, their logprobs and the prompt logprobs equal
    peft's each time, and the base model's equal transformers' (no K/V shared across)."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8,
              max_num_batched_tokens=5, enable_prefix_caching=True)
    lora = LoRARequest("all", 1, adapter)
    ids = _ids(llm, PROMPTS[2])
    longer = ids + _ids(llm, PROMPTS[0])
    for prompt, prompt_logprobs in ((ids, 1), (ids, None), (longer, None)):
        # prompt logprobs skip prefix-cache reads: only the later rounds can hit
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                prompt_logprobs=prompt_logprobs)
        outs = llm.generate([prompt, prompt], params, lora_request=[lora, None],
                            use_tqdm=False)
        for path, out in zip((adapter, None), outs):
            tokens = list(out.outputs[0].token_ids)
            _check_against(peft_logprobs(tiny_llama.path, path, prompt + tokens), prompt, out)
    assert llm.engine.core.kv_cache_manager.num_hits > 0
    assert_no_leaks(llm)


def test_prompt_logprobs_with_prefix_hits_and_chunks_match_hf(tiny_llama, assert_no_leaks):
    """Prompt logprobs (top-3) of a prompt whose first blocks are cached (by a request that
    asked for none), computed in 3-token chunks: every position's logprobs equal
    transformers' (a prompt-logprobs request reads no cached block, so none is left out),
    and a later request without prompt logprobs still hits the blocks it wrote."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=3, enable_prefix_caching=True)
    ids = _ids(llm, PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([ids[:9]], plain, use_tqdm=False)  # caches the first two blocks
    out = llm.generate([ids], params, use_tqdm=False)[0]
    ref = peft_logprobs(tiny_llama.path, None, ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry[ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(3).indices.tolist()
        for t in top:
            assert entry[t].logprob == pytest.approx(ref[p - 1, t].item(), abs=1e-4)
    again = llm.generate([ids], plain, use_tqdm=False)[0]
    assert llm.engine.core.kv_cache_manager.num_hits > 0
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert_no_leaks(llm)


def _same_logprobs(got: list, want: list) -> None:
    """Two lists of {token: Logprob} rows hold the same tokens and logprobs (within 1e-5)."""
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert {t: e.logprob for t, e in x.items()} == \
            pytest.approx({t: e.logprob for t, e in y.items()}, abs=1e-5)


@pytest.mark.parametrize("name,num_blocks", [("llama", 16), ("gemma3", 24)])
def test_int8_kv_prefix_caching_chunks_and_swap_equal_a_plain_int8_engine(
        name, num_blocks, tiny_model_factory, monkeypatch, assert_no_leaks):
    """INT8 KV cache with prefix caching, a 7-token step budget and swap preemption (a pool of
    a few blocks; gemma3 adds a sliding-window group, prompts up to 5 windows long): tokens,
    logprobs and prompt logprobs equal those of an int8 engine with a 256-block pool, whole
    prompts per step and no prefix caching (int8 rounding differs from transformers' fp32 by
    up to ~0.06 in a logprob, so the oracle is the plain int8 engine, to 1e-5)."""
    from tests.core.swap_checks import always_swap, assert_swapped_back_and_pools_idle
    from tests.models.test_parity import _prompts

    tiny = tiny_model_factory(name)
    prompts = _prompts([41, 37, 30], tiny.vocab_size, seed=3)
    prompts.append(prompts[0][:33] + prompts[1][:5])  # shares 8 blocks with the first
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_prompt = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                                 prompt_logprobs=1)
    kw = {"model": tiny.path, "dtype": "float32", "device": "cpu", "block_size": 4,
          "kv_cache_dtype": "int8"}
    plain = LLM(num_kv_blocks=256, enable_prefix_caching=False, **kw)
    want = plain.generate(prompts, with_prompt, use_tqdm=False)
    always_swap(monkeypatch)
    llm = LLM(num_kv_blocks=num_blocks, enable_prefix_caching=True, max_num_batched_tokens=7,
              preemption_mode="swap", swap_space="1MiB", **kw)
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # cached: the next round hits
    for params in (greedy, with_prompt):
        got = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(got, want):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            _same_logprobs(a.outputs[0].logprobs, b.outputs[0].logprobs)
            if params is with_prompt:
                _same_logprobs(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
    assert llm.engine.core.kv_cache_manager.num_hits > 0
    assert_swapped_back_and_pools_idle(llm.engine.core)
    assert_no_leaks(llm)


def test_ngram_speculation_lora_seeded_samples_match_peft(tiny_llama, adapter,
                                                          assert_no_leaks):
    """n=3 seeded samples (temperature 0.3) with n-gram drafts and a LoRA adapter: every
    sampled token's logprob is peft's (the drafts were verified with the adapter), the same
    seed gives the same samples again, and the samples differ from each other."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "adaptive": False})
    lora = LoRARequest("all", 1, adapter)
    ids = _ids(llm, PROMPTS[0]) * 2  # repeats: the n-gram proposer finds drafts
    params = SamplingParams(temperature=0.3, n=3, seed=7, max_tokens=16, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    first = llm.generate([ids], params, lora_request=lora, use_tqdm=False)[0]
    again = llm.generate([ids], params, lora_request=lora, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert first.metrics.num_drafts > 0
    for sample in first.outputs:
        ref = peft_logprobs(tiny_llama.path, adapter, ids + list(sample.token_ids))
        got = [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)]
        want = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(sample.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
    assert_no_leaks(llm)


def test_draft_model_speculation_with_lora_equals_peft_greedy(tiny_llama, adapter,
                                                              assert_no_leaks):
    """A draft model (the base model itself, without the adapter) proposing for a target
    running the adapter: the verified greedy tokens and their logprobs are peft's with the
    adapter (the drafts, which the adapter changes, are rejected where they differ); the
    base-model row of the same batch is the base model's."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8,
              speculative_config={"method": "draft_model", "model": tiny_llama.path,
                                  "num_speculative_tokens": 3, "adaptive": False})
    lora = LoRARequest("all", 1, adapter)
    ids = _ids(llm, PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with_lora, base = llm.generate([ids, ids], params, lora_request=[lora, None],
                                   use_tqdm=False)
    assert with_lora.metrics.num_drafts > 0
    for out, folder in ((with_lora, adapter), (base, None)):
        ref = peft_logprobs(tiny_llama.path, folder, ids + list(out.outputs[0].token_ids))
        assert list(out.outputs[0].token_ids) == \
            ref[len(ids) - 1:-1].argmax(-1).tolist()
        _check_against(ref, ids, out)
    assert with_lora.outputs[0].token_ids != base.outputs[0].token_ids
    assert_no_leaks(llm)
