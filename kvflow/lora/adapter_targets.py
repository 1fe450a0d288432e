"""Which modules a PEFT LoRA adapter's ``adapter_config.json`` adapts, as peft decides it
(``target_modules``, ``exclude_modules``, ``layers_to_transform`` with ``layers_pattern``:
peft's ``check_target_module_exists``, 0.13-0.21), checked against the modules its weights
hold. peft adapts only what the config names and drops other weights silently; vLLM applies
whatever the weights hold; kvflow refuses an adapter where the two disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["PEFT_DEFAULT_TARGET_MODULES", "check_target_fields", "check_weights_in_config",
           "weightless_targets"]

# The modules peft adapts when adapter_config.json has no target_modules, by the base model's
# config.json model_type: peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (0.21),
# for the model types kvflow can adapt (tests/lora/test_lora_default_targets.py checks it
# against the installed peft). peft refuses such a config for a model type it has no entry
# for ("Please specify `target_modules`"): phi3, qwen2_moe, qwen3_moe, deepseek_v2,
# deepseek_v3, qwen2_vl, qwen2_5_vl, granite, granitemoe, olmo2, glm, glm4; so does kvflow.
PEFT_DEFAULT_TARGET_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    model_type: ("q_proj", "v_proj")
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2",
                       "gemma3_text")})


def check_target_fields(config: dict[str, Any], where: str) -> None:
    """``target_modules`` / ``exclude_modules`` (a regex or a list of names),
    ``layers_to_transform`` (a layer index or a list of them) and ``layers_pattern`` (a name
    or a list of names) must have the types peft reads.

    Raises:
        ValueError: naming ``where`` and the field.
    """
    def names(value: Any) -> bool:
        return isinstance(value, str) or (isinstance(value, list) and
                                           all(isinstance(v, str) for v in value))

    def index(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    checks = [("target_modules", names, "a regex or a list of module names"),
              ("exclude_modules", names, "a regex or a list of module names"),
              ("layers_pattern", names, "a name or a list of names"),
              ("layers_to_transform", lambda v: index(v) or (
                  isinstance(v, list) and all(index(i) for i in v)),
               "a layer index or a list of layer indices")]
    for field, valid, what in checks:
        value = config.get(field)
        if value is not None and not valid(value):
            raise ValueError(f"{where} {field}={value!r}: must be {what}")


def _names_match(names: str | list[str], module: str) -> bool:
    """peft's matching of ``target_modules`` / ``exclude_modules``: a string is a regex the
    whole module name must match; a list holds names or name suffixes."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return module in names or any(module.endswith(f".{name}") for name in names)


def _layer_index(module: str, patterns: str | list[str] | None) -> int | None:
    """The layer index in ``module`` as peft finds it: the first number after any segment, or
    after one of ``layers_pattern``'s names."""
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        patterns = [patterns] if isinstance(patterns, str) else patterns
        match = next((m for m in (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
                                  for p in patterns) if m), None)
    return None if match is None else int(match["idx"])


def _field_leaving_out(config: dict[str, Any], module: str) -> str | None:
    """The ``adapter_config.json`` field by which peft would not adapt ``module`` (a PEFT
    module name without ``base_model.model.``): ``exclude_modules``, ``target_modules`` or
    ``layers_to_transform``; None when peft adapts it, or when ``target_modules`` is unset
    (peft then picks by model type). As peft's ``check_target_module_exists`` (0.13-0.21):
    a regex ``target_modules`` ignores ``layers_to_transform``; ``all-linear`` names every
    linear layer but the output head."""
    exclude, targets = config.get("exclude_modules"), config.get("target_modules")
    if exclude and _names_match(exclude, module):
        return "exclude_modules"
    if targets is None:
        return None
    if isinstance(targets, str) and targets != "all-linear":
        return None if _names_match(targets, module) else "target_modules"
    if targets != "all-linear" and not _names_match(targets, module):
        return "target_modules"
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    index = _layer_index(module, config.get("layers_pattern"))
    wanted = [layers] if isinstance(layers, int) else layers
    return None if index is not None and index in wanted else "layers_to_transform"


def _with_default_targets(config: dict[str, Any], model_type: str | None,
                          path: str) -> dict[str, Any]:
    """``config`` with ``target_modules`` set as peft sets it when the file has none: its
    default for ``model_type`` (``PEFT_DEFAULT_TARGET_MODULES``).

    Raises:
        ValueError: naming the folder and the model type when peft has no default for it.
    """
    if config.get("target_modules") is not None:
        return config
    default = PEFT_DEFAULT_TARGET_MODULES.get(model_type or "")
    if default is None:
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_config.json has no target_modules, and peft has "
            f"no default target modules for model type {model_type!r} (it refuses such a "
            "config): name the adapted modules in target_modules")
    return {**config, "target_modules": list(default)}


def _shown_field(config: dict[str, Any], field: str, effective: dict[str, Any],
                 model_type: str | None) -> str:
    """``field=value`` as the errors name it; an unset ``target_modules`` as peft's default."""
    if field == "target_modules" and config.get(field) is None:
        return (f"target_modules (unset: peft's default for model type {model_type!r}, "
                f"{effective[field]!r})")
    return f"{field}={config.get(field)!r}"


def _listed(modules: list[str]) -> str:
    return ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4
                                     else "")


def check_weights_in_config(config: dict[str, Any], peft_modules: list[str], path: str,
                            model_type: str | None) -> None:
    """Every module with weights (``peft_modules``: PEFT names without ``base_model.model.``)
    must be one ``adapter_config.json`` adapts (without ``target_modules``: the ones peft
    adapts by default for the base model's ``model_type``): peft adapts only what the config
    names (and drops other weights without a word), vLLM applies whatever the weights hold,
    so such an adapter is refused rather than served as either.

    Raises:
        ValueError: naming the folder, the field, its value and the modules it leaves out;
            or, for a config without ``target_modules``, a ``model_type`` peft has no
            default for.
    """
    effective = _with_default_targets(config, model_type, path)
    left_out: dict[str, list[str]] = {}
    for peft_module in peft_modules:
        field = _field_leaving_out(effective, peft_module)
        if field is not None:
            left_out.setdefault(field, []).append(peft_module)
    for field, modules in left_out.items():
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_model.safetensors holds weights for "
            f"{_listed(modules)}, which adapter_config.json's "
            f"{_shown_field(config, field, effective, model_type)} leaves out (peft would "
            "load the adapter without them, vLLM would apply them): make the config and the "
            "weights agree")


def weightless_targets(config: dict[str, Any], model_type: str | None,
                       model_modules: list[str], weight_modules: list[str],
                       renamed: bool) -> str | None:
    """The modules the config adapts that hold no weights, as a warning's text (None when
    there are none): peft loads zero deltas there and warns of missing adapter keys; kvflow
    serves them unadapted, the same output.

    Args:
        config: the parsed ``adapter_config.json`` (its weights already checked by
            ``check_weights_in_config``).
        model_type: the base model's ``model_type``.
        model_modules: every module of the model kvflow can adapt, unfused (``q_proj``,
            not ``qkv_proj``), in kvflow's names.
        weight_modules: the modules the adapter holds weights for, in the same names.
        renamed: whether the model renames checkpoint modules (Qwen2-VL): a regex
            ``target_modules`` / ``exclude_modules`` written against the checkpoint's names
            is then not matched (no warning), name lists are (they match name suffixes).
    """
    effective = _with_default_targets(config, model_type, "")
    regex = any(isinstance(effective.get(f), str) and effective.get(f) != "all-linear"
                for f in ("target_modules", "exclude_modules"))
    if renamed and regex:
        return None
    held = set(weight_modules)
    missing = [m for m in sorted(model_modules)
               if m not in held and _field_leaving_out(effective, m) is None]
    if not missing:
        return None
    return (f"adapter_config.json's {_shown_field(config, 'target_modules', effective, model_type)} "
            f"names {len(missing)} module{'s' * (len(missing) != 1)} that "
            f"adapter_model.safetensors has no weights for, served unadapted (as peft, which "
            f"warns of missing adapter keys, loads zero deltas there): {_listed(missing)}")
