"""Prompt logprobs of the quantization tests: the engine's (``prompt_logprobs=0``) and a
transformers model's (the oracle: the checkpoint dequantized by hand, or loaded by
transformers itself)."""

from __future__ import annotations

import torch

from kvflow import LLM, SamplingParams


def hf_prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[:i + 1]) under transformers ``model``, i = 0 .. len(ids) - 2."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(ids[1:])]


def engine_prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The engine's logprob of each prompt token after the first (one request, one token
    generated)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
