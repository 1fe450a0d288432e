"""An adapter folder whose weights are integers or hold NaN/infinity, or an adapter path that
does not exist or is a file, is one ``ValueError`` naming the tensor or the path, raised when
the adapter loads.

Before: an int64 lora_A was cast to float and applied (other tokens than peft, which refuses
such a file); a NaN in lora_A made the adapted request's logits NaN, and it ended after one
token; a missing path or a file was "LoRA adapter '.../adapter_config.json' has no
adapter_config.json"."""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import make_adapter

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return make_adapter(tiny_llama.path, str(tmp_path_factory.mktemp("lora") / "qv"), 3, r=4,
                        lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4, enable_lora=True, max_lora_rank=8)


def _generate(llm: LLM, path: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params,
                       lora_request=LoRARequest("bad", 7, path))
    return out[0].outputs[0].token_ids


def _edited(adapter: str, folder, edit) -> str:
    path = shutil.copytree(adapter, str(folder))
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)
    return path


def test_integer_weight_is_refused(llm, adapter, tmp_path):
    path = _edited(adapter, tmp_path / "int", lambda t: t.update({Q_A: t[Q_A].long()}))
    with pytest.raises(ValueError) as info:
        _generate(llm, path)
    assert str(info.value) == (f"adapter tensor {Q_A!r} of {path!r} has dtype torch.int64; "
                               "LoRA weights must be floating point")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused(llm, adapter, tmp_path, value):
    def poison(tensors):
        tensors[Q_A][1, 2] = value

    path = _edited(adapter, tmp_path / "nan", poison)
    with pytest.raises(ValueError) as info:
        _generate(llm, path)
    assert str(info.value) == (f"adapter tensor {Q_A!r} of {path!r} holds NaN or infinite "
                               "values (a diverged or corrupt training run?)")


def test_missing_path_and_file_path_say_so(llm, adapter, tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError) as info:
        _generate(llm, missing)
    assert str(info.value) == f"LoRA adapter {missing!r} does not exist (a PEFT folder is expected)"
    file = os.path.join(adapter, "adapter_config.json")
    with pytest.raises(ValueError) as info:
        _generate(llm, file)
    assert str(info.value) == (f"LoRA adapter {file!r} is a file, not a folder (a PEFT folder "
                               "with adapter_config.json is expected)")


def test_the_engine_still_serves_the_good_adapter(llm, adapter, tiny_llama):
    """Run after the refusals above (same engine): nothing is left half-loaded, and the good
    adapter generates peft's greedy tokens (the oracle of tests/lora)."""
    from tests.lora.adapters import peft_greedy

    assert _generate(llm, adapter) == peft_greedy(tiny_llama.path, adapter, [5, 6, 7])[:4]
