"""Random PEFT LoRA adapters made with peft, and transformers + peft greedy decoding (the
oracle of the LoRA tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

MAX_TOKENS = 12
# The prompts and target lists the multi-LoRA engine tests share.
PROMPTS = ["the quick brown fox jumps over", "prefix caching reuses them, chunked prefill",
           "a lazy dog while kvflow pages keys and values through blocks"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, folder: str, seed: int, **lora_kwargs: Any) -> str:
    """A PEFT LoRA adapter with random A and B (peft initializes B to zero), saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(folder)
    return folder


def make_mixed_adapters(base_path: str, root: Any) -> dict[str, str]:
    """The adapters of the multi-LoRA engine tests, saved under folder ``root``: ``all``
    (every linear layer, r=8, alpha 16), ``qv`` (q, v and down, r=4, rsLoRA) and
    ``too_wide`` (q only, r=16: refused by an engine with ``max_lora_rank=8``)."""
    return {
        "all": make_adapter(base_path, str(root / "all"), 1, r=8, lora_alpha=16,
                            target_modules=ALL_LINEAR),
        "qv": make_adapter(base_path, str(root / "qv"), 2, r=4, lora_alpha=8,
                           use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
        "too_wide": make_adapter(base_path, str(root / "wide"), 6, r=16,
                                 target_modules=["q_proj"]),
    }


def make_late_adapter(base_path: str, root: Any) -> str:
    """Adapter ``late`` (k, o and up, r=2, alpha 4), saved under folder ``root``: the one the
    parallel tests load, run and remove while the engine serves."""
    return make_adapter(base_path, str(root / "late"), 5, r=2, lora_alpha=4,
                        target_modules=["k_proj", "o_proj", "up_proj"])


def peft_greedy(base_path: str, adapter: str | None, prompt_ids: list[int]) -> list[int]:
    """transformers (+ peft for an adapter) greedy tokens, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


# Tolerances of a tensor-parallel run against peft (see check_tokens_against_peft).
LOGPROB_ATOL = 1e-4
NEAR_TIE = 1e-3


def peft_logprobs(base_path: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab]: log p(. | ids[:p + 1]) under transformers (+ peft)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_tokens_against_peft(base_path: str, adapter: str | None, prompt_ids: list[int],
                              tokens: list[int], token_logprobs: list[float]) -> None:
    """An engine's greedy ``tokens`` (and their logprobs) against peft run on the same
    tokens (teacher forcing, fp32): each must be peft's argmax there or within ``NEAR_TIE``
    of it, its logprob peft's within ``LOGPROB_ATOL``.

    Why 1e-4: at TP=2 every row-parallel sum (o_proj, down_proj and their LoRA deltas) is
    split into two halves that the all-reduce adds, so the engine and peft round
    differently. fp32's unit roundoff is u = 2^-24 ~ 6e-8 and a dot product of n terms errs
    by at most n u times the sum of its terms' magnitudes (Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1): n = 128 (the tiny models' MLP width) and logits of up to ~10
    give ~8e-5 per logit, which the log-softmax passes on. Measured at TP=2: at most 3e-6. A
    missed, doubled or rank-partial LoRA delta moves logprobs by more than 1e-1 (the random
    adapters' weights are 0.3 x randn).
    """
    assert len(tokens) == len(token_logprobs) == MAX_TOKENS
    ref = peft_logprobs(base_path, adapter, prompt_ids + tokens)
    for i, (token, logprob) in enumerate(zip(tokens, token_logprobs)):
        row = ref[len(prompt_ids) - 1 + i]
        assert row.max().item() - row[token].item() < NEAR_TIE, \
            f"{adapter}: token {i} ({token}) is not peft's greedy pick {row.argmax().item()}"
        assert abs(logprob - row[token].item()) <= LOGPROB_ATOL, (adapter, i, logprob,
                                                                  row[token].item())


def assert_output_matches_peft(base_path: str, adapter: str | None, prompt: list[int],
                               out: Any) -> None:
    """One completion's greedy tokens and their logprobs (``out``: a CompletionOutput asked
    with ``logprobs=1``) against peft on the same tokens (:func:`check_tokens_against_peft`)."""
    tokens = list(out.token_ids)
    check_tokens_against_peft(base_path, adapter, prompt, tokens,
                              [entry[t].logprob for t, entry in zip(tokens, out.logprobs)])


def mixed_batch_matches_peft(llm: Any, base_path: str, adapters: dict[str, str],
                             prompts: list[str], params: Any) -> tuple[list[list[int]], list]:
    """Run ``prompts`` in one batch under adapters ``all`` (id 1), ``qv`` (id 2) and the base
    model, and check every output against peft; returns the prompts' ids and the outputs."""
    from kvflow.lora.request import LoRARequest

    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in prompts]
    loras = [LoRARequest("all", 1, adapters["all"]), LoRARequest("qv", 2, adapters["qv"]),
             None]
    outs = llm.generate(ids, params, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(ids, loras, outs):
        assert_output_matches_peft(base_path, lora and lora.lora_path, prompt, out.outputs[0])
    return ids, outs


def reload_and_refusal_match_peft(llm: Any, base_path: str, adapters: dict[str, str],
                                  ids: list[list[int]], outs: list, params: Any) -> Any:
    """After :func:`mixed_batch_matches_peft` (``ids``, ``outs``) on a parallel engine:
    adapter ``late`` loaded as id 3 (on every rank), run on ``ids[0]`` and removed, id 3
    reused for folder ``qv`` on ``ids[1]`` (a rank that kept the old weights would decode
    ``late``), both checked against peft; then ``too_wide`` refused naming
    ``max_lora_rank=8``, and the base model still serving ``ids[2]`` as before. Returns the
    reused id's output."""
    from kvflow.lora.request import LoRARequest

    late = llm.generate([ids[0]], params, lora_request=LoRARequest("late", 3, adapters["late"]),
                        use_tqdm=False)[0]
    assert_output_matches_peft(base_path, adapters["late"], ids[0], late.outputs[0])
    assert llm.engine.core.remove_lora(3)
    # another prompt, so that only the slot is tested here (the prefix cache's keying of a
    # reused id: tests/lora/test_lora_engine.py)
    again = llm.generate([ids[1]], params, lora_request=LoRARequest("qv_again", 3,
                                                                    adapters["qv"]),
                         use_tqdm=False)[0]
    assert_output_matches_peft(base_path, adapters["qv"], ids[1], again.outputs[0])
    with pytest.raises(ValueError, match="exceeds max_lora_rank=8"):
        llm.generate("hi", params, lora_request=LoRARequest("wide", 4, adapters["too_wide"]))
    base = llm.generate([ids[2]], params, use_tqdm=False)[0]  # every rank still serves
    assert base.outputs[0].token_ids == outs[2].outputs[0].token_ids
    return again
