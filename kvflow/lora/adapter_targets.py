"""Which modules a PEFT LoRA adapter's ``adapter_config.json`` adapts, as peft decides it
(``target_modules``, ``exclude_modules``, ``layers_to_transform`` with ``layers_pattern``:
peft's ``check_target_module_exists``, 0.13-0.21), checked against the modules its weights
hold. peft adapts only what the config names and drops other weights silently; vLLM applies
whatever the weights hold; kvflow refuses an adapter where the two disagree.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["check_target_fields", "check_weights_in_config"]


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


def check_weights_in_config(config: dict[str, Any], peft_modules: list[str],
                             path: str) -> None:
    """Every module with weights (``peft_modules``: PEFT names without ``base_model.model.``)
    must be one ``adapter_config.json`` adapts: peft adapts only
    what the config names (and drops other weights without a word), vLLM applies whatever the
    weights hold, so such an adapter is refused rather than served as either.

    Raises:
        ValueError: naming the folder, the field, its value and the modules it leaves out.
    """
    left_out: dict[str, list[str]] = {}
    for peft_module in peft_modules:
        field = _field_leaving_out(config, peft_module)
        if field is not None:
            left_out.setdefault(field, []).append(peft_module)
    for field, modules in left_out.items():
        shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more"
                                          if len(modules) > 4 else "")
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_model.safetensors holds weights for {shown}, "
            f"which adapter_config.json's {field}={config.get(field)!r} leaves out (peft "
            "would load the adapter without them, vLLM would apply them): make the config "
            "and the weights agree")
