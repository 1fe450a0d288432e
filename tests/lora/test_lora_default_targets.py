"""An adapter_config.json without ``target_modules``, and target modules without weights, with
peft as the oracle.

peft adapts, when the config names no modules, its default modules for the base model's
``model_type`` (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) and drops other weights;
for a model type it has no default for it refuses the config. kvflow did not cross-check such
a config at all (it applied every weight). It now embeds peft's rule for the model types it
can adapt (``PEFT_DEFAULT_TARGET_MODULES``, checked here against the installed peft), and
logs the modules a config adapts that hold no weights, as peft warns of missing keys."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shutil
import warnings

import pytest
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.lora.adapter_targets import PEFT_DEFAULT_TARGET_MODULES
from kvflow.lora.request import LoRARequest
from kvflow.models.registry import MODEL_REGISTRY
from tests.lora.adapters import MAX_TOKENS, make_adapter, peft_greedy

PROMPT = [1, 40, 41, 42, 43, 44]
_ids = iter(range(300, 1000))


def _lora_model_types() -> set[str]:
    """The transformers model types of kvflow's architectures that take LoRA adapters (by
    transformers' own architecture -> model type tables)."""
    from transformers.models.auto import modeling_auto

    lora_archs = {arch for arch, cls in MODEL_REGISTRY.items()
                  if getattr(cls, "supported_lora_modules", None)}
    tables = [modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
              modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]
    return {model_type for table in tables for model_type, arch in table.items()
            if arch in lora_archs}


def test_embedded_defaults_are_peft_mapping():
    """For every model type kvflow adapts, the embedded default is peft's (absent where peft
    has none, so both refuse the config)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    model_types = _lora_model_types()
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2_vl"} <= model_types
    ours = {t: PEFT_DEFAULT_TARGET_MODULES.get(t) for t in sorted(model_types)}
    peft = {t: None if PEFT.get(t) is None else tuple(PEFT[t]) for t in sorted(model_types)}
    assert ours == peft
    assert set(PEFT_DEFAULT_TARGET_MODULES) <= model_types  # no entry for what kvflow lacks


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4, enable_lora=True, max_lora_rank=8)


def _kvflow(llm: LLM, path: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params,
                       lora_request=LoRARequest(os.path.basename(path), next(_ids), path))
    return list(out[0].outputs[0].token_ids)


def _without_target_modules(adapter: str, folder: str, drop: str | None = None) -> str:
    """A copy of ``adapter`` whose config has no target_modules; ``drop``: the weights of
    modules whose names contain it are removed."""
    shutil.copytree(adapter, folder)
    config_file = os.path.join(folder, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    del config["target_modules"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    if drop is not None:
        file = os.path.join(folder, "adapter_model.safetensors")
        save_file({k: v for k, v in load_file(file).items() if drop not in k}, file)
    return folder


def test_default_targets_load_as_peft(llm, tiny_llama, tmp_path):
    """q/v weights, no target_modules: peft adapts q/v (llama's default), so does kvflow; the
    adapter changes the output (the oracle is not the base model's)."""
    qv = make_adapter(tiny_llama.path, str(tmp_path / "qv"), 31, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    path = _without_target_modules(qv, str(tmp_path / "qv_default"))
    expected = peft_greedy(tiny_llama.path, path, PROMPT)
    assert expected == peft_greedy(tiny_llama.path, qv, PROMPT)
    assert expected != peft_greedy(tiny_llama.path, None, PROMPT)
    assert _kvflow(llm, path) == expected


def test_weights_outside_the_default_targets_are_refused(llm, tiny_llama, tmp_path):
    """q/v/down weights, no target_modules: peft drops down_proj (its tokens differ from the
    whole adapter's); kvflow refuses, naming the default."""
    qvd = make_adapter(tiny_llama.path, str(tmp_path / "qvd"), 32, r=4, lora_alpha=8,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    path = _without_target_modules(qvd, str(tmp_path / "qvd_default"))
    assert peft_greedy(tiny_llama.path, path, PROMPT) != peft_greedy(tiny_llama.path, qvd,
                                                                     PROMPT)
    with pytest.raises(ValueError) as e:
        _kvflow(llm, path)
    assert str(e.value) == (
        f"LoRA adapter {path!r}: adapter_model.safetensors holds weights for "
        "model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj, which "
        "adapter_config.json's target_modules (unset: peft's default for model type "
        "'llama', ['q_proj', 'v_proj']) leaves out (peft would load the adapter without them, "
        "vLLM would apply them): make the config and the weights agree")


def test_model_type_without_a_default_is_refused(tiny_model_factory, tmp_path):
    """Phi-3 (fused qkv_proj): peft has no default target modules for it and refuses the
    config; so does kvflow, naming the model type."""
    phi3 = tiny_model_factory("phi3_longrope")
    adapter = make_adapter(phi3.path, str(tmp_path / "phi3"), 33, r=4, lora_alpha=8,
                           target_modules=["qkv_proj"])
    path = _without_target_modules(adapter, str(tmp_path / "phi3_default"))
    with pytest.raises(ValueError, match="specify `target_modules`"):
        peft_greedy(phi3.path, path, PROMPT)
    llm = LLM(model=phi3.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError) as e:
        _kvflow(llm, path)
    assert str(e.value) == (
        f"LoRA adapter {path!r}: adapter_config.json has no target_modules, and peft has no "
        "default target modules for model type 'phi3' (it refuses such a config): name the "
        "adapted modules in target_modules")


def _peft_missing_modules(tiny_llama, path: str) -> list[str]:
    """The modules peft's missing-adapter-keys warning names when it loads ``path``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_greedy(tiny_llama.path, path, PROMPT)
    found = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    keys = ast.literal_eval(found[0][found[0].index("["):found[0].rindex("]") + 1])
    return sorted({re.sub(r"^base_model\.model\.|\.lora_[AB]\.default\.weight$", "", k)
                   for k in keys})


def _kvflow_missing_modules(llm, path: str, caplog) -> tuple[str, list[str]]:
    """kvflow's one warning for ``path`` (its text) and the modules it names."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvflow.lora.adapter"):
        _kvflow(llm, path)
    found = [r.getMessage() for r in caplog.records if r.name == "kvflow.lora.adapter"]
    assert len(found) == 1, found
    return found[0], found[0].rpartition(": ")[2].split(", ")


@pytest.mark.parametrize("case", ["named_o_proj", "default_targets"])
def test_targets_without_weights_are_logged_as_peft_warns(llm, tiny_llama, tmp_path, caplog,
                                                          case):
    """The modules kvflow's warning names are the ones of peft's missing-keys warning:
    o_proj named with no o_proj weights (and layer 1's down_proj weights removed); and
    llama's default q/v with layer 1's v_proj weights removed. One warning per load."""
    if case == "named_o_proj":
        made = make_adapter(tiny_llama.path, str(tmp_path / "made"), 34, r=4, lora_alpha=8,
                            target_modules=["q_proj", "down_proj"])
        path = str(tmp_path / case)
        shutil.copytree(made, path)
        with open(f"{path}/adapter_config.json") as f:
            config = json.load(f)
        config["target_modules"] = ["q_proj", "down_proj", "o_proj"]
        with open(f"{path}/adapter_config.json", "w") as f:
            json.dump(config, f)
        file = f"{path}/adapter_model.safetensors"
        save_file({k: v for k, v in load_file(file).items()
                   if "layers.1.mlp.down_proj" not in k}, file)
        field = "target_modules=['q_proj', 'down_proj', 'o_proj']"
    else:
        made = make_adapter(tiny_llama.path, str(tmp_path / "made"), 35, r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj"])
        path = _without_target_modules(made, str(tmp_path / case),
                                       drop="layers.1.self_attn.v_proj")
        field = "target_modules (unset: peft's default for model type 'llama', " \
                "['q_proj', 'v_proj'])"
    expected = _peft_missing_modules(tiny_llama, path)
    message, modules = _kvflow_missing_modules(llm, path, caplog)
    assert modules == expected
    n = len(expected)
    assert message == (
        f"LoRA adapter {case!r} ({path}): adapter_config.json's {field} names {n} module"
        f"{'s' * (n != 1)} that adapter_model.safetensors has no weights for, served "
        "unadapted (as peft, which warns of missing adapter keys, loads zero deltas there): "
        f"{', '.join(expected)}")
    assert _kvflow(llm, path) == peft_greedy(tiny_llama.path, path, PROMPT)
