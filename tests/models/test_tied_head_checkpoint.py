"""A config that ties the LM head to the embedding (``tie_word_embeddings: true``) over a
checkpoint that also stores an ``lm_head.weight``: transformers ties the two only when the
stored tensors are equal and otherwise computes logits with the stored head, so kvflow
(whose tied head reads the embedding) refuses a different stored head in one line naming
the field, and loads an equal one.

Before: the stored head was skipped without a word, and kvflow generated other tokens than
transformers (on the tiny Llama: [68, 68, 68, ...] against transformers' own head's)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams

PROMPT = [5, 6, 7, 8]


def _tied_copy(folder, source: str, head_from_embedding: bool) -> str:
    """A copy of model folder ``source`` with config ``tie_word_embeddings: true`` and a
    stored ``lm_head.weight``: the checkpoint's own untied head, or the embedding's copy."""
    path = shutil.copytree(source, str(folder))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    with open(config_path, "w") as f:
        json.dump(config, f)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    if head_from_embedding:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    assert "lm_head.weight" in tensors
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def _hf_greedy(path: str) -> tuple[list[int], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist(), model


def _kvflow_greedy(path: str) -> list[int]:
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids


def test_different_stored_head_is_refused(tiny_llama, tmp_path):
    path = _tied_copy(tmp_path / "model", tiny_llama.path, head_from_embedding=False)
    _, hf = _hf_greedy(path)  # the reason: transformers keeps the stored head, untied
    stored = load_file(os.path.join(path, "model.safetensors"))["lm_head.weight"]
    assert torch.equal(hf.lm_head.weight, stored)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError) as info:
        _kvflow_greedy(path)
    assert str(info.value) == (
        "config.json sets tie_word_embeddings=true, but the checkpoint's lm_head.weight "
        "differs from model.embed_tokens.weight; transformers then computes the logits with "
        'lm_head.weight, untied. Set "tie_word_embeddings": false in config.json to load '
        "that head")


def test_equal_stored_head_loads_tied(tiny_llama, tmp_path):
    path = _tied_copy(tmp_path / "model", tiny_llama.path, head_from_embedding=True)
    want, _ = _hf_greedy(path)
    assert _kvflow_greedy(path) == want
