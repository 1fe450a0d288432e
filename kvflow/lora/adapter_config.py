"""``adapter_config.json`` of a PEFT LoRA folder: reading it, refusing what kvflow cannot
apply before any tensor is read, and the per-module rank / alpha it gives (PEFT's
``rank_pattern`` / ``alpha_pattern``; scaling ``lora_alpha / r``, or ``lora_alpha / sqrt(r)``
under rsLoRA: Hu et al. 2021, eq. 3; Kalajdzievski 2023)."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from kvflow.lora.adapter_targets import check_target_fields


def read_adapter_config(path: str) -> dict[str, Any]:
    """The folder's ``adapter_config.json``.

    Raises:
        ValueError: when the folder does not exist or is a file, the file is missing, or it is
            not a JSON object.
    """
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.exists(path):
        raise ValueError(f"LoRA adapter {path!r} does not exist (a PEFT folder is expected)")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is a file, not a folder (a PEFT folder with "
                         "adapter_config.json is expected)")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json (a PEFT folder is "
                         "expected)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path!r}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{config_path!r} holds a JSON {type(config).__name__}, not an object")
    return config


def check_adapter_config(config: dict[str, Any], max_rank: int,
                         where: str = "adapter_config.json", adapter: str = "") -> None:
    """Refuse what kvflow cannot apply, before any tensor is read.

    Args:
        config: the parsed ``adapter_config.json``.
        max_rank: ``--max-lora-rank``.
        where: the file, as the errors name it.
        adapter: the adapter's name (its ``lora_name``), as the rank error names it.

    Raises:
        ValueError: naming ``where`` and the field, for a non-LoRA PEFT type, DoRA, trained
            biases (``bias``, ``lora_bias``), ``modules_to_save``, ``fan_in_fan_out`` weights,
            activated LoRA (``alora_invocation_tokens``), ``layer_replication``,
            ``target_parameters``, ``trainable_token_indices``, an ``init_lora_weights`` that
            changed the base weights (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ), a rank (``r``,
            ``rank_pattern``) that is not a positive integer or is above ``max_rank``, an
            alpha (``lora_alpha``, ``alpha_pattern``) that is not a number, or a
            ``target_modules`` / ``exclude_modules`` / ``layers_to_transform`` /
            ``layers_pattern`` of a type peft does not read.
    """
    _refuse_unsupported_features(config, where)
    check_target_fields(config, where)
    _check_ranks_and_alphas(config, max_rank, where, adapter)


def _refuse_unsupported_features(config: dict[str, Any], where: str) -> None:
    """Refuse a PEFT type other than LoRA and the LoRA variants kvflow cannot apply.

    Raises:
        ValueError: naming ``where`` and the first such field (see
            :func:`check_adapter_config`).
    """
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter peft_type={peft_type!r}: kvflow serves LORA adapters only")
    refused = [("use_dora", config.get("use_dora"), "DoRA adapters are not supported"),
               ("bias", config.get("bias", "none") not in (None, "none"),
                "adapters that train biases are not supported"),
               ("modules_to_save", config.get("modules_to_save"),
                "adapters with fully trained modules are not supported"),
               ("fan_in_fan_out", config.get("fan_in_fan_out"),
                "fan_in_fan_out (Conv1D) weights are not supported"),
               ("lora_bias", config.get("lora_bias"),
                "adapters with a bias on lora_B are not supported"),
               ("alora_invocation_tokens", config.get("alora_invocation_tokens"),
                "activated LoRA (applied after its invocation tokens only) is not supported"),
               ("layer_replication", config.get("layer_replication"),
                "adapters that duplicate the base model's layers are not supported"),
               ("target_parameters", config.get("target_parameters"),
                "LoRA on parameters (e.g. fused MoE experts) is not supported"),
               ("trainable_token_indices", config.get("trainable_token_indices"),
                "adapters that retrain token embeddings are not supported"),
               ("init_lora_weights", _changes_base_weights(config.get("init_lora_weights")),
                _BASE_CHANGED)]
    for name, bad, why in refused:
        if bad:
            raise ValueError(f"{where} {name}={config.get(name)!r}: {why}")


def _check_ranks_and_alphas(config: dict[str, Any], max_rank: int, where: str,
                            adapter: str) -> None:
    """``r`` / ``rank_pattern`` positive integers at most ``max_rank``, ``lora_alpha`` /
    ``alpha_pattern`` numbers.

    Raises:
        ValueError: naming ``where`` and the field, or :func:`rank_error` for a rank above
            ``max_rank``.
    """
    ranks = _checked_values(config, "r", "rank_pattern", 8, where, _is_rank,
                            "a LoRA rank must be a positive integer")
    _checked_values(config, "lora_alpha", "alpha_pattern", 8, where, _is_number,
                    "a LoRA alpha must be a number")
    if max(ranks) > max_rank:
        raise rank_error(adapter, max(ranks), max_rank, where)


def rank_error(adapter: str, rank: int, max_rank: int, where: str) -> ValueError:
    """The error for ``adapter`` (its name) of LoRA rank ``rank`` above ``max_rank``, naming
    it and ``where`` it was read from."""
    named = f"LoRA adapter {adapter!r}" if adapter else "LoRA adapter"
    return ValueError(f"{named} ({where}): rank {rank} exceeds "
                      f"max_lora_rank={max_rank} (start the engine with --max-lora-rank "
                      f"{rank} or more)")


_BASE_CHANGED = ("this initialization changed the base weights the adapter was trained on "
                 "(peft rebuilds them when it loads the adapter; kvflow serves the unchanged "
                 "base): convert it to a plain LoRA adapter with peft's save_pretrained("
                 "path_initial_model_for_weight_conversion=...)")


def _changes_base_weights(init: Any) -> bool:
    """Whether a saved ``init_lora_weights`` means the adapter runs on modified base weights:
    PiSSA (``pissa``, ``pissa_niter_K``), OLoRA, CorDA and LoRA-GA subtract the initial
    adapter from the base; LoftQ replaces it by a quantized residual (peft's conversion to a
    plain adapter saves ``init_lora_weights: true``)."""
    return isinstance(init, str) and (init.lower().startswith("pissa") or
                                      init.lower() in ("olora", "corda", "lora_ga", "loftq"))


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _checked_values(config: dict[str, Any], key: str, pattern_key: str, default: Any,
                    where: str, valid, why: str) -> list[Any]:
    """``config[key]`` and the values of ``config[pattern_key]`` (PEFT's per-module
    overrides, an object), each checked by ``valid``.

    Raises:
        ValueError: naming ``where`` and the first field that is not valid.
    """
    patterns = config.get(pattern_key) or {}
    if not isinstance(patterns, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{where} {pattern_key}={patterns!r}: must be an object (module pattern -> value)")
    fields = [(key, config.get(key, default)),
              *((f"{pattern_key}[{k!r}]", v) for k, v in patterns.items())]
    for name, value in fields:
        if not valid(value):
            raise ValueError(f"{where} {name}={value!r}: {why}")
    return [value for _, value in fields]


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: a pattern key matches a module whose name ends with it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """The factor ``module``'s ``B A`` is multiplied by: its alpha (``alpha_pattern``, else
    ``lora_alpha``, PEFT's default 8) over ``rank``, or over ``sqrt(rank)`` with
    ``use_rslora``."""
    alpha = float(pattern_value(config.get("alpha_pattern"), module,
                                config.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
