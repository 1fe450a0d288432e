"""adapter_config.json's ``target_modules`` / ``layers_to_transform`` / ``exclude_modules``
against the weights, with peft as the oracle.

peft adapts only the modules the config names and drops other weights without a word; kvflow
applied every weight it found (as vLLM does), so an adapter whose config leaves out modules
that have weights generated other tokens than peft. Such an adapter is now a ValueError
naming the folder, the field and the modules. A config naming modules without weights is
what peft loads with zero deltas there (it warns of missing keys): kvflow's output matches."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import MAX_TOKENS, make_adapter, peft_greedy

PROMPT = [1, 40, 41, 42, 43, 44]
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    """q/v/down in both layers of the tiny Llama, rank 4."""
    return make_adapter(tiny_llama.path, str(tmp_path_factory.mktemp("targets") / "qvd"), 21,
                        r=4, lora_alpha=8, target_modules=TARGETS)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4, enable_lora=True, max_lora_rank=8)


@pytest.fixture(scope="module")
def peft_full(tiny_llama, adapter) -> list[int]:
    """peft's tokens for the unedited adapter: kvflow's output before, for every case below
    (it applied all the weights)."""
    return peft_greedy(tiny_llama.path, adapter, PROMPT)


_ids = iter(range(100, 1000))


def _kvflow(llm: LLM, path: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params,
                       lora_request=LoRARequest(os.path.basename(path), next(_ids), path))
    return list(out[0].outputs[0].token_ids)


def _edited(adapter: str, folder, config_edit=None, weights_edit=None) -> str:
    path = str(folder)
    shutil.copytree(adapter, path)
    if config_edit is not None:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        config.update(config_edit)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    if weights_edit is not None:
        file = os.path.join(path, "adapter_model.safetensors")
        save_file(weights_edit(load_file(file)), file)
    return path


def test_unedited_adapter_matches_peft(llm, adapter, peft_full):
    assert _kvflow(llm, adapter) == peft_full


REFUSED = {
    # weights for down_proj, which target_modules does not name
    "target_modules": ({"target_modules": ["q_proj", "v_proj"]},
                       "model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj",
                       "target_modules=['q_proj', 'v_proj']"),
    # weights for both layers, the config restricts to layer 0
    "layers_to_transform": ({"layers_to_transform": [0]},
                            ("model.layers.1.mlp.down_proj, model.layers.1.self_attn.q_proj, "
                            "model.layers.1.self_attn.v_proj"), "layers_to_transform=[0]"),
    "layers_pattern": ({"layers_to_transform": 1, "layers_pattern": "layers"},
                       ("model.layers.0.mlp.down_proj, model.layers.0.self_attn.q_proj, "
                       "model.layers.0.self_attn.v_proj"),
                       "layers_to_transform=1"),
    "exclude_modules": ({"exclude_modules": ["model.layers.1.self_attn.q_proj"]},
                        "model.layers.1.self_attn.q_proj",
                        "exclude_modules=['model.layers.1.self_attn.q_proj']"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_weights_the_config_leaves_out_are_refused(llm, tiny_llama, adapter, peft_full,
                                                   tmp_path, case):
    edit, modules, field = REFUSED[case]
    path = _edited(adapter, tmp_path / case, edit)
    # peft drops those weights: its tokens differ from the whole adapter's (kvflow's before)
    assert peft_greedy(tiny_llama.path, path, PROMPT) != peft_full
    with pytest.raises(ValueError) as e:
        _kvflow(llm, path)
    assert str(e.value) == (
        f"LoRA adapter {path!r}: adapter_model.safetensors holds weights for {modules}, "
        f"which adapter_config.json's {field} leaves out (peft would load the adapter "
        "without them, vLLM would apply them): make the config and the weights agree")


def test_config_naming_modules_without_weights_matches_peft(llm, tiny_llama, adapter,
                                                            tmp_path):
    """o_proj named, no o_proj weights; layer 1's down_proj weights removed: peft keeps zero
    deltas there (warning of missing keys), kvflow applies what the weights hold."""
    def drop_layer1_down(tensors):
        return {k: v for k, v in tensors.items() if "layers.1.mlp.down_proj" not in k}

    path = _edited(adapter, tmp_path / "named_without_weights",
                   {"target_modules": [*TARGETS, "o_proj"]}, drop_layer1_down)
    with pytest.warns(UserWarning, match="missing adapter keys"):
        expected = peft_greedy(tiny_llama.path, path, PROMPT)
    assert _kvflow(llm, path) == expected


def test_matching_restrictions_load_as_peft(llm, tiny_llama, adapter, tmp_path):
    """A regex target_modules matching every weight, and a peft adapter made with
    layers_to_transform (weights for layer 1 only): served as peft serves them."""
    regex = _edited(adapter, tmp_path / "regex",
                    {"target_modules": r".*\.(q_proj|v_proj|down_proj)"})
    assert _kvflow(llm, regex) == peft_greedy(tiny_llama.path, regex, PROMPT)
    layer1 = make_adapter(tiny_llama.path, str(tmp_path / "layer1"), 22, r=4, lora_alpha=8,
                          target_modules=TARGETS, layers_to_transform=[1])
    assert sorted(load_file(f"{layer1}/adapter_model.safetensors")) == sorted(
        f"base_model.model.model.layers.1.{m}.lora_{ab}.weight" for ab in "AB"
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    assert _kvflow(llm, layer1) == peft_greedy(tiny_llama.path, layer1, PROMPT)


@pytest.mark.parametrize("edit, message", [
    ({"target_modules": 3}, "target_modules=3: must be a regex or a list of module names"),
    ({"layers_to_transform": ["0"]},
     "layers_to_transform=['0']: must be a layer index or a list of layer indices"),
], ids=["target_modules", "layers_to_transform"])
def test_field_of_the_wrong_type_is_refused(llm, adapter, tmp_path, edit, message):
    path = _edited(adapter, tmp_path / "typed", edit)
    with pytest.raises(ValueError) as e:
        _kvflow(llm, path)
    assert str(e.value) == f"{os.path.join(path, 'adapter_config.json')!r} {message}"
