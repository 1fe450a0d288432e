"""``--hf-overrides`` (vLLM's flag; ``LLM(hf_overrides=...)``): a JSON object merged into the
model's config.json before kvflow checks and reads it.

The merge follows vLLM's rule for a dict of overrides: each top-level key replaces the
config's value, except that an object given for a nested config (a key the transformers
config class lists in ``sub_configs``, e.g. a vision-language model's ``text_config``) is
merged into it, recursively (objects inside it merge into objects, anything else replaces).
vLLM sets the keys on the transformers config after building it; kvflow merges them into the
parsed config.json before transformers builds the config, so fields a config class derives
in its constructor (Qwen2's ``layer_types`` from ``sliding_window``) follow the overridden
values, and config.json's checks (:mod:`kvflow.models.hf_config_checks`) see the merged file.
The tokenizer is read from the folder as it is: overrides change the model, not its tokens.
"""

from __future__ import annotations

import copy
from typing import Any

from kvflow.config.model import HF_OVERRIDES_FLAG as FLAG


def merge_hf_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A new config.json dict: ``raw`` with ``overrides`` merged in (module docstring's rule);
    ``raw`` is left as it is.

    Args:
        raw: the parsed config.json (its ``model_type`` picks the transformers config class
            whose ``sub_configs`` are merged into rather than replaced).
        overrides: the parsed ``--hf-overrides`` object.
    """
    merged = copy.deepcopy(raw)
    nested = _sub_config_keys(raw.get("model_type"))
    for key, value in overrides.items():
        if key in nested and isinstance(value, dict) and isinstance(merged.get(key), dict):
            _merge_nested(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge_nested(target: dict[str, Any], updates: dict[str, Any]) -> None:
    """vLLM's nested update: objects merge into objects, other values replace."""
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_nested(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _sub_config_keys(model_type: Any) -> frozenset[str]:
    """The nested-config keys of the transformers config class for ``model_type`` (empty for
    an unknown type)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return frozenset()
    return frozenset(getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {})


def config_from_dict(raw: dict[str, Any], folder: str) -> Any:
    """The transformers config of a (merged) config.json dict, as ``AutoConfig.from_pretrained``
    builds it from a file: the class named by ``model_type`` (a ``mistral`` config with
    ``layer_types`` read as ``ministral``, transformers' rule), ``from_dict``.

    Raises:
        ValueError: for a missing or unknown ``model_type``.
    """
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type == "mistral" and "layer_types" in raw:
        model_type = "ministral"
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"model config in {folder!r} with {FLAG}: model_type="
                         f"{model_type!r} is not a transformers model type")
    config = CONFIG_MAPPING[model_type].from_dict(dict(raw))
    config._name_or_path = folder
    return config
