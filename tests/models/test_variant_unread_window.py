"""A ``sliding_window`` in the config.json of a Granite, OLMo 2 or GLM-4 model: transformers'
classes for them never read it (as its Llama), so kvflow attends to every token as they do
and logs the unread field by name (before: kvflow applied the window, 8 tokens here, and its
greedy tokens for a 30-token prompt could differ from transformers' on the same folder)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvflow import LLM
from tests.folder_edits import copy_with_json
from tests.models.test_parity import _prompts, assert_matches_hf, greedy


@pytest.mark.parametrize("name, model_type", [("olmo2", "olmo2"), ("glm4", "glm4"),
                                              ("granite_moe", "granitemoe")])
def test_variant_config_window_is_not_applied_and_is_named(tiny_model_factory, tmp_path,
                                                           caplog, name, model_type):
    tiny = tiny_model_factory(name)
    config_path = copy_with_json(tiny.path, tmp_path / f"{name}-window", sliding_window=8)
    with open(config_path) as f:
        assert json.load(f)["model_type"] == model_type
    with caplog.at_level(logging.WARNING, logger="kvflow.models.loader"):
        llm = LLM(model=os.path.dirname(config_path), dtype="float32", device="cpu",
                  num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert [r.getMessage() for r in caplog.records if r.name == "kvflow.models.loader"] == [
        (f"model config {config_path!r}: sliding_window=8 is not read: a {model_type!r} "
         "model attends to every token, as transformers' class for it does")]
    groups = llm.engine.core.kv_cache_config.kv_cache_groups
    assert [g.kv_cache_spec.sliding_window for g in groups] == [None] * len(groups)
    for out in llm.generate(_prompts([30, 27], tiny.vocab_size, seed=3), greedy(),
                            use_tqdm=False):
        assert_matches_hf(tiny, out)  # transformers' class ignores the window
