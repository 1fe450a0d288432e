"""End-to-end parity of kvflow with HF transformers on tiny random-weight models (fp32, CPU).

For every architecture the greedy tokens must equal HF ``generate(do_sample=False)`` and the
logprob of each generated token must match HF's ``log_softmax`` of that step's logits, for one
request, a batch of prompts of different lengths, and under engine stress: chunked prefill with
a tiny token budget, prefix caching on and off (prompts sharing a long prefix), and a KV cache so
small that requests are preempted and recomputed. Tokens may only diverge where HF's top-2
logprobs tie within tolerance (the architecture's oracle rule). After each test no KV block is
leaked.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvflow import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "llama_rope_llama3", "llama_rope_linear", "qwen2_rope_yarn",
         "llama_rope_yarn", "llama_rope_dynamic", "llama_tied",
         "mistral_sliding_window", "qwen2_layer_types", "gemma3", "phi3_longrope",
         "mixtral", "qwen2_moe", "qwen3_moe", "granite", "gemma2",
         "granite_moe", "olmo2", "glm", "glm4"]
ATOL = 1e-4
MAX_TOKENS = 10


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class HFReference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] log_softmax of the raw logits


_HF_CACHE: dict[tuple, HFReference] = {}


def hf_greedy(tiny, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> HFReference:
    """HF greedy continuation (EOS ignored) and per-step logprobs; cached per model/prompt."""
    from transformers import GenerationConfig

    key = (tiny.name, tuple(prompt), max_new_tokens)
    if key not in _HF_CACHE:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                               min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            out = tiny.hf_model.generate(torch.tensor([prompt]), generation_config=cfg)
        logits = torch.stack([step[0] for step in out.logits]).float()
        _HF_CACHE[key] = HFReference(out.sequences[0, len(prompt):].tolist(),
                                     torch.log_softmax(logits, dim=-1))
    return _HF_CACHE[key]


def assert_matches_hf(tiny, request_output, max_new_tokens: int = MAX_TOKENS) -> None:
    """Greedy tokens equal HF's and each sampled token's logprob is within ATOL of HF's."""
    ref = hf_greedy(tiny, request_output.prompt_token_ids, max_new_tokens)
    completion = request_output.outputs[0]
    tokens = completion.token_ids
    assert len(tokens) == max_new_tokens, completion
    assert completion.finish_reason == "length"
    for step, (ours, theirs) in enumerate(zip(tokens, ref.tokens)):
        lp = ref.logprobs[step]
        if ours != theirs:
            top2 = lp.topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * ATOL, (
                f"{tiny.name}: token {step} differs (kvflow {ours}, HF {theirs}) without a "
                f"near-tie in HF's logprobs; kvflow {tokens}, HF {ref.tokens}")
            return  # a legitimate tie: the continuations may differ from here on
        got = completion.logprobs[step][ours].logprob
        assert got == pytest.approx(float(lp[theirs]), abs=ATOL), \
            f"{tiny.name}: logprob of token {step} ({ours}): kvflow {got}, HF {float(lp[theirs])}"
        assert completion.logprobs[step][ours].rank == 1


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)]
                     if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """The engine's device: CPU always, CUDA too when one is visible (HF runs on CPU)."""
    return request.param


@pytest.fixture(params=ARCHS)
def tiny(request, tiny_model_factory):
    """Each tiny architecture in turn."""
    return tiny_model_factory(request.param)


@pytest.fixture
def make_llm(tiny, device):
    """``make_llm(**engine_kwargs) -> LLM`` on the current tiny model and device (fp32, blocks
    of 4 tokens, at most 8 sequences)."""

    def make(**kwargs) -> LLM:
        kwargs = {"num_kv_blocks": 128, "block_size": 4, "max_num_seqs": 8, **kwargs}
        return LLM(model=tiny.path, dtype="float32", device=device, **kwargs)

    return make


def test_single_request(tiny, make_llm, assert_no_leaks):
    llm = make_llm()
    (prompt,) = _prompts([13], tiny.vocab_size, seed=1)
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert out.prompt_token_ids == prompt
    assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_batch_of_different_lengths(tiny, make_llm, assert_no_leaks, cpu_kernels):
    """Mixed prefill and decode; with the native CPU kernels and without (``cpu_kernels``),
    soft-capped attention logits (Gemma 2) included."""
    llm = make_llm()
    if llm.engine.core.executor.runner.device.type == "cpu":
        backend = llm.engine.core.executor.runner.attn_ctx.backend.name
        assert backend == ("cpu" if cpu_kernels == "native" else "torch")
    prompts = _prompts([1, 5, 13, 22, 9], tiny.vocab_size, seed=2)
    text = "the lazy fox pages keys and values"
    outs = llm.generate([*prompts, text], greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs[:-1]] == prompts
    assert outs[-1].prompt == text
    assert outs[-1].prompt_token_ids == llm.get_tokenizer().encode(text)
    for out in outs:
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_batch_of_equal_lengths(tiny, make_llm, assert_no_leaks):
    """Whole prompts of one length take the torch backend's gather-free batched path."""
    llm = make_llm()
    prompts = _prompts([11, 11, 11], tiny.vocab_size, seed=3)
    for out in llm.generate(prompts, greedy(), use_tqdm=False):
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_chunked_prefill(tiny, make_llm, assert_no_leaks, cpu_kernels):
    """A 16-token budget splits the long prompts over steps and mixes chunks with decodes; with
    the native CPU kernels and without (``cpu_kernels``)."""
    llm = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = _prompts([40, 7, 23, 16, 17], tiny.vocab_size, seed=3)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for out in outs:
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
def test_shared_prefix(tiny, make_llm, prefix_caching, assert_no_leaks):
    """Prompts sharing a 26-token prefix; the batch runs twice on one engine, so with prefix
    caching the second run (and siblings in the first) reuse cached blocks. Outputs equal HF's
    either way."""
    llm = make_llm(enable_prefix_caching=prefix_caching, max_num_batched_tokens=32)
    prefix = _prompts([26], tiny.vocab_size, seed=4)[0]
    prompts = [prefix + s for s in _prompts([3, 7, 1, 12], tiny.vocab_size, seed=5)]
    prompts.append(prefix[:21])  # ends inside a block of the shared prefix
    prompts.append(prefix[:24])  # ends on a block boundary: a full hit still computes 1 token
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    second = llm.generate(prompts, greedy(), use_tqdm=False)
    for a, b in zip(first, second):
        assert_matches_hf(tiny, a)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (tok,) = [t for t in step_a if step_a[t].rank == 1]
            assert step_b[tok].logprob == pytest.approx(step_a[tok].logprob, abs=ATOL)
    hits = llm.engine.core.kv_cache_manager.num_hits
    assert (hits > 0) == prefix_caching
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
def test_preemption(tiny, make_llm, prefix_caching, assert_no_leaks):
    """7 usable blocks of 4 tokens (28 tokens) for 4 requests that each grow to 18-24 tokens:
    the scheduler must preempt and recompute, and the outputs still equal HF's."""
    # Models mixing full and sliding-window layers keep one block table per KV-cache group,
    # each block holding one group's layers: the same 7 blocks per group keep the pressure.
    types = set(getattr(tiny.hf_model.config, "layer_types", None) or ())
    groups = 2 if {"full_attention", "sliding_attention"} <= types else 1
    llm = make_llm(num_kv_blocks=1 + 7 * groups, enable_prefix_caching=prefix_caching,
                   max_num_batched_tokens=16)
    prompts = _prompts([9, 14, 8, 11], tiny.vocab_size, seed=6)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)
