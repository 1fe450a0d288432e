"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against HF transformers' log-softmax
of the prompt's logits, through chunked prefill, a batch, prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams


def _hf_prompt_logprobs(tiny, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is log p(. | prompt[:p + 1])."""
    with torch.no_grad():
        logits = tiny.hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check(tiny, out, num_top: int) -> None:
    prompt = out.prompt_token_ids
    ref = _hf_prompt_logprobs(tiny, prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        step, row = out.prompt_logprobs[p], ref[p - 1]
        token = prompt[p]
        assert step[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert step[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(num_top)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            if tid in step and tid != token:
                assert step[tid].logprob == pytest.approx(lp, abs=1e-4)
                assert step[tid].rank == rank
        assert len(step) in (num_top, num_top + 1)


@pytest.mark.parametrize("budget", [64, 5])  # 5: the prompt is computed in chunks
def test_prompt_logprobs_match_hf(tiny_llama, budget):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=budget)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, tiny_llama.vocab_size, (n,), generator=gen).tolist()
               for n in (1, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        _check(tiny_llama, out, 3)
    plain = llm.generate(prompts[1:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_ignore_prefix_cache_and_survive_preemption(tiny_llama):
    """A repeated prompt (whose blocks are cached) still gets every prompt logprob; a cache
    too small for the batch preempts requests mid-prompt without duplicating entries."""
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=12, block_size=4,
              max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(2, tiny_llama.vocab_size, (17,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt, prompt[:13], prompt[:15]], params, use_tqdm=False)
    for out in (first, *again):
        _check(tiny_llama, out, 0)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_bad_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)  # -1: the whole vocabulary (vLLM's)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
