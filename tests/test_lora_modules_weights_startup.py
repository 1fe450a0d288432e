"""``kvflow serve --lora-modules NAME=PATH`` with an adapter refused only once its weights are
read (lora_A/B shapes for another base model's hidden size, a module the model does not
have): one ``kvflow: error:`` line naming the flag and the tensor, exit 2, as the refusals
found in ``adapter_config.json`` (tests/test_lora_modules_precheck.py).

Before: the adapters loaded in uvicorn's lifespan, so starlette logged the ValueError as a
20-line traceback, uvicorn added "Application startup failed. Exiting." and exited 3."""

from __future__ import annotations

import json
import os

import pytest
import torch


def _adapter(folder: str, module: str, in_features: int, out_features: int) -> str:
    """A rank-4 PEFT folder holding lora_A [4, in_features] / lora_B [out_features, 4] of
    ``module`` (no peft needed: the refusals are about the names and shapes)."""
    from safetensors.torch import save_file

    os.makedirs(folder)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                   "target_modules": [module.rpartition(".")[2]]}, f)
    prefix = f"base_model.model.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.full((4, in_features), 0.1),
               f"{prefix}.lora_B.weight": torch.full((out_features, 4), 0.1)},
              os.path.join(folder, "adapter_model.safetensors"))
    return folder


CASES = {
    # the tiny Llama's hidden size is 64: an adapter made for a 32-wide model
    "hidden_size": ("model.layers.0.self_attn.q_proj", 32, 64,
                    ("adapter module 'base_model.model.model.layers.0.self_attn.q_proj' has "
                     "lora_A (4, 32) and lora_B (64, 4); the layer needs [r, 64] and [64, r] "
                     "(an adapter for another base model?)")),
    # the tiny Llama has 2 layers
    "missing_layer": ("model.layers.7.mlp.down_proj", 128, 64,
                      ("LoRA target module 'base_model.model.model.layers.7.mlp.down_proj' "
                       "cannot be applied: this model has no module 'model.layers.7.mlp."
                       "down_proj' (an adapter for another base model?)")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_refused_at_start_up_is_one_line(tiny_llama, tmp_path, case, capfd):
    """``kvflow serve`` run in this process (``cli.main``: the status it returns is the
    process's exit status, tests/test_cli.py), its engine-core process in its own: the
    stderr of both (file descriptor 2) holds the one line."""
    from kvflow.entrypoints.cli import main

    module, in_features, out_features, reason = CASES[case]
    folder = _adapter(str(tmp_path / case), module, in_features, out_features)
    status = main(["serve", tiny_llama.path, "--port", "0", "--dtype", "float32", "--device",
                   "cpu", "--num-kv-blocks", "32", "--block-size", "4", "--enable-lora",
                   "--max-lora-rank", "8", "--lora-modules", f"bad={folder}"])
    stderr = capfd.readouterr().err
    assert status == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines()
              if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"kvflow: error: --lora-modules bad={folder}: {reason}"], stderr[-3000:]
