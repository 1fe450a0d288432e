"""A ``sliding_window`` in a Llama config.json: transformers' Llama never reads it (its Mistral
does), so kvflow attends to every token as transformers does and logs the unread field.

Before: kvflow's Llama applied the window (8 tokens here) and its greedy tokens for a
30-token prompt differed from transformers' on the same folder."""

from __future__ import annotations

import json
import logging
import os

from kvflow import LLM
from tests.folder_edits import copy_with_json
from tests.models.test_parity import _prompts, assert_matches_hf, greedy


def test_llama_config_window_is_not_applied_and_is_named(tiny_llama, tmp_path, caplog):
    config_path = copy_with_json(tiny_llama.path, tmp_path / "llama-window", sliding_window=8)
    folder = os.path.dirname(config_path)
    with open(config_path) as f:
        assert json.load(f)["model_type"] == "llama"
    with caplog.at_level(logging.WARNING, logger="kvflow.models.loader"):
        llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=16)
    assert [r.getMessage() for r in caplog.records if r.name == "kvflow.models.loader"] == [
        (f"model config {config_path!r}: sliding_window=8 is not read: a 'llama' model attends "
        "to every token, as transformers' Llama does (a windowed model is model_type "
        "'mistral', MistralForCausalLM)")]
    groups = llm.engine.core.kv_cache_config.kv_cache_groups
    assert [g.kv_cache_spec.sliding_window for g in groups] == [None] * len(groups)
    prompts = _prompts([30, 27], tiny_llama.vocab_size, seed=3)
    for out in llm.generate(prompts, greedy(), use_tqdm=False):
        assert_matches_hf(tiny_llama, out)  # transformers' Llama, all 30 tokens attended
