"""A draft model that fails to load says it is the draft: the loader's message follows
``speculative_config model NAME:``.

Before: a draft whose config.json did not describe its checkpoint stopped the engine with
"checkpoint tensor 'lm_head.weight': shape (320, 64): the config gives [vocab_size,
hidden_size] = [320, 128]", which read as a fault of the target model the user had asked
for (it loaded fine)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvflow import LLM


def test_draft_checkpoint_error_names_the_draft(tiny_llama, tmp_path):
    draft = shutil.copytree(tiny_llama.path, str(tmp_path / "draft"))
    config_path = os.path.join(draft, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["hidden_size"] = 128  # the checkpoint's is 64
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as info:
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
            block_size=4, speculative_config={"model": draft, "num_speculative_tokens": 2})
    # the config is checked against the checkpoint's headers before the draft is built
    assert str(info.value) == (
        f"speculative_config model {draft!r}: model config {config_path!r}: hidden_size=128 "
        "is larger than the checkpoint's embedding 'model.embed_tokens.weight' of shape "
        "[320, 64] ([vocab_size, hidden_size])")


def test_draft_config_error_names_the_draft(tiny_llama, tmp_path):
    draft = shutil.copytree(tiny_llama.path, str(tmp_path / "draft"))
    config_path = os.path.join(draft, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["rms_norm_eps"] = -1.0
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as info:
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
            block_size=4, speculative_config={"model": draft, "num_speculative_tokens": 2})
    assert str(info.value) == (f"speculative_config model {draft!r}: model config "
                               f"{config_path!r}: rms_norm_eps=-1.0 is invalid; it must be a "
                               "number >= 0")
