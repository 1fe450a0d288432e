"""Random PEFT LoRA adapters made with peft, and transformers + peft greedy decoding (the
oracle of the LoRA tests)."""

from __future__ import annotations

from typing import Any

import torch

MAX_TOKENS = 12


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
