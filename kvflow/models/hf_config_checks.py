"""Checks of a model folder's config.json made before transformers reads it.

transformers fills a missing size with its class default (LlamaConfig: 4096 hidden, 32 layers)
and builds a config with zero or negative sizes, so such a file used to fail much later with a
message about something else: a checkpoint "lacking" layers 30-31, a pipeline-parallel size
exceeding "-1 layers", torch refusing a negative tensor dimension, or ``integer modulo by
zero``. Here each is one ``ValueError`` naming the file and the field. So are the fields transformers
reads leniently and kvflow would otherwise apply silently: an ``architectures`` string (read
letter by letter), a ``quantization_config`` that is not an object with a ``quant_method``, a
negative norm epsilon or sliding window, and RoPE parameters out of transformers' range (it only
logs a warning for a ``factor`` below 1, and kvflow generated from a zero one).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from kvflow.layers.rope_parameters import MAX_ROPE_POSITIONS, ROPE_TYPES, rope_max_positions

# every architecture kvflow serves describes its transformer with these
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# checked when present (null means "derive it", e.g. a Mistral config's head_dim)
OPTIONAL_SIZES = ("num_key_value_heads", "intermediate_size", "head_dim",
                  "max_position_embeddings")


def read_config_json(path: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parsed config.json at ``path`` with ``hf_overrides`` merged in
    (:func:`kvflow.models.hf_overrides.merge_hf_overrides`), its sizes and other fields
    checked (see :func:`check_config_sizes` and :func:`check_config_fields`) after the merge.

    Raises:
        ValueError: naming ``path``: it cannot be read, is not valid JSON (with the line and
            column), is not a JSON object, or a size or another checked field is missing or
            invalid (then also naming ``--hf-overrides`` when overrides were merged).
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read model config {path!r}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model config {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"model config {path!r} is not a JSON object (it is a {type(raw).__name__})")
    if not hf_overrides:
        check_config_sizes(raw, path)
        check_config_fields(raw, path)
        return raw
    from kvflow.models.hf_overrides import FLAG, merge_hf_overrides

    merged = merge_hf_overrides(raw, hf_overrides)
    try:
        check_config_sizes(merged, path)
        check_config_fields(merged, path)
    except ValueError as e:
        raise ValueError(f"{e} (config.json with {FLAG} {json.dumps(hf_overrides)[:200]} "
                         "merged in)") from None
    return merged


def check_config_sizes(raw: dict[str, Any], path: str) -> None:
    """Check the transformer sizes of a parsed config.json: :data:`REQUIRED_SIZES` present and
    every size positive integers, and ``num_attention_heads`` a multiple of
    ``num_key_value_heads`` (grouped-query attention shares each KV head among a whole number
    of query heads), and ``max_position_embeddings`` at most :data:`MAX_ROPE_POSITIONS`. A vision-language config keeps them in ``text_config``, where a size left
    out takes the default of transformers' config class for its ``model_type`` (as
    transformers builds the sub-config: llava-hf/llava-1.5-7b-hf's ``text_config`` names only
    ``vocab_size`` and a few more); a size at the top level wins, as in
    :func:`kvflow.models.loader.hoist_text_config`.

    Raises:
        ValueError: naming ``path`` and the field, with its value and the reason.
    """
    text = raw.get("text_config")
    text = text if isinstance(text, dict) else {}
    defaults = sub_config_defaults(text.get("model_type"))
    sizes: dict[str, int] = {}
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = raw.get(name, text.get(name, defaults.get(name)))
        if value is None:
            if name in REQUIRED_SIZES:
                raise ValueError(f"model config {path!r} has no {name!r}; kvflow needs it to "
                                 "build the model (is this a complete config.json?)")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model config {path!r}: {name}={value!r} is invalid; it must be "
                             "a positive integer")
        sizes[name] = value
    positions = sizes.get("max_position_embeddings")
    if positions is not None and positions > MAX_ROPE_POSITIONS:
        raise ValueError(f"model config {path!r}: max_position_embeddings={positions} is above "
                         f"the {MAX_ROPE_POSITIONS} positions kvflow tables (the RoPE or "
                         "position-embedding table has one row per position; is the file "
                         "corrupt?)")
    heads, kv_heads = sizes["num_attention_heads"], sizes.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"model config {path!r}: num_attention_heads={heads} is not a multiple "
                         f"of num_key_value_heads={kv_heads}")


@functools.lru_cache(maxsize=8)
def sub_config_defaults(model_type: Any) -> dict[str, Any]:
    """The field defaults of transformers' config class for ``model_type`` (a sub-config's:
    ``llama``, ``mistral``, ...); empty for a type transformers does not know or None."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return {}
    try:
        return CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs arguments
        return {}


EPSILONS = ("rms_norm_eps", "layer_norm_eps")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_config_fields(raw: dict[str, Any], path: str) -> None:
    """Check the non-size fields kvflow reads from a parsed config.json (the top level; a
    vision-language config's ``text_config`` for the epsilons and window): ``architectures`` a
    list of class names; ``quantization_config`` null or an object with a string
    ``quant_method``; :data:`EPSILONS` finite numbers >= 0; a ``sliding_window`` that applies
    (``use_sliding_window`` not false) a positive integer.

    Raises:
        ValueError: naming ``path`` and the field, with its value and what is expected.
    """
    arches = raw.get("architectures")
    if arches is not None and (not isinstance(arches, list)
                               or not all(isinstance(a, str) for a in arches)):
        raise ValueError(f"model config {path!r}: architectures={arches!r} is invalid; it must "
                         'be a list of model class names, e.g. ["LlamaForCausalLM"]')
    quant = raw.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict)
                                  and isinstance(quant.get("quant_method"), str)):
        raise ValueError(f"model config {path!r}: quantization_config={quant!r:.200} is "
                         "invalid; it must be an object naming its \"quant_method\" (kvflow "
                         "reads 'compressed-tensors', 'gptq', 'awq' and block-wise "
                         "'fp8'), or be left out for "
                         "float weights")
    text = raw.get("text_config")
    text = text if isinstance(text, dict) else {}
    for name in EPSILONS:
        value = raw.get(name, text.get(name))
        if value is not None and not (_is_number(value) and value >= 0):
            raise ValueError(f"model config {path!r}: {name}={value!r} is invalid; it must be "
                             "a number >= 0")
    window = raw.get("sliding_window", text.get("sliding_window"))
    applies = raw.get("use_sliding_window", text.get("use_sliding_window", True)) is not False
    if window is not None and applies and (isinstance(window, bool)
                                           or not isinstance(window, int) or window <= 0):
        raise ValueError(f"model config {path!r}: sliding_window={window!r} is invalid; it "
                         "must be a positive integer (tokens), or null for full attention")


# model types whose transformers attention reads no ``sliding_window`` from the config
WINDOWLESS_MODEL_TYPES = frozenset({"llama", "granite", "granitemoe", "olmo2", "glm", "glm4"})


def unread_field_warnings(raw: dict[str, Any], path: str) -> list[str]:
    """Warnings for config.json fields that transformers' own model class never reads, so
    kvflow, which matches its output, does not either: today a ``sliding_window`` in the
    config of a :data:`WINDOWLESS_MODEL_TYPES` model (e.g. transformers' Llama attends to
    every token; a windowed model is ``MistralForCausalLM`` / ``model_type`` ``mistral``).

    Returns:
        One message per unread field, naming ``path``, the field and its value (empty when
        every field set is read).
    """
    window, model_type = raw.get("sliding_window"), raw.get("model_type")
    if model_type == "llama" and window:
        return [(f"model config {path!r}: sliding_window={window!r} is not read: a 'llama' "
                "model attends to every token, as transformers' Llama does (a windowed model "
                "is model_type 'mistral', MistralForCausalLM)")]
    if model_type in WINDOWLESS_MODEL_TYPES and window:
        return [(f"model config {path!r}: sliding_window={window!r} is not read: a "
                 f"{model_type!r} model attends to every token, as transformers' class for it "
                 "does")]
    return []


# rope types whose ``factor`` stretches the positions (transformers' RoPE validation: >= 1)
_FACTOR_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope", "su")


def check_rope_parameters(config: Any, path: str, raw: dict[str, Any] | None = None) -> None:
    """Check the RoPE parameters of a loaded transformers config (``rope_parameters``, one
    dict or one per layer type as Gemma 3's; transformers 5 has moved an older
    ``rope_scaling`` / ``rope_theta`` there): ``rope_type`` one kvflow implements
    (:data:`~kvflow.layers.rope_parameters.ROPE_TYPES`; transformers only warns of an unknown
    one, and kvflow refused it only when building the model, without naming the file),
    ``rope_theta`` a finite number > 0 and, for a
    scaling type, ``factor`` (when given) a finite number >= 1. transformers only logs a
    warning for such values; kvflow built its cos/sin table from them (a zero ``factor``
    generated a constant token). LongRoPE (``longrope`` / ``su``) in a per-layer-type entry is
    refused: kvflow's long-prompt rows (``layers.rotary.long_prompt_rope``) cover one
    model-wide LongRoPE only.

    Args:
        config: the loaded config.
        path: its config.json, for the errors.
        raw: the parsed config.json (with any ``hf_overrides``), to name an unknown
            ``rope_type`` by the field the file writes (an older ``rope_scaling``); None:
            ``rope_parameters``.

    Raises:
        ValueError: naming ``path``, the field and its value.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return
    per_type = params if "rope_theta" not in params and all(
        isinstance(v, dict) for v in params.values()) else {None: params}
    for layer_type, entry in per_type.items():
        _check_rope_entry(entry, layer_type, path, raw)


def _check_rope_entry(entry: dict[str, Any], layer_type: str | None, path: str,
                      raw: dict[str, Any] | None) -> None:
    """One ``rope_parameters`` entry (``layer_type``'s, or the model's for None): see
    :func:`check_rope_parameters`.

    Raises:
        ValueError: naming ``path``, the field and its value.
    """
    where = "rope_parameters" + ("" if layer_type is None else f"[{layer_type!r}]")
    theta = entry.get("rope_theta")
    if theta is not None and not (_is_number(theta) and theta > 0):
        raise ValueError(f"model config {path!r}: {where}.rope_theta={theta!r} is "
                         "invalid; it must be a number > 0 (the RoPE base)")
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"model config {path!r}: "
                         f"{_rope_type_field(entry, layer_type, raw)}={rope_type!r} is not "
                         f"supported; kvflow's RoPE implements {', '.join(ROPE_TYPES)}")
    if layer_type is not None and rope_type in ("longrope", "su"):
        raise ValueError(f"model config {path!r}: {where}.rope_type={rope_type!r} is not "
                         "supported per layer type: transformers rotates a prompt longer "
                         "than original_max_position_embeddings with the long factors at "
                         "every position, which kvflow does only for one model-wide "
                         "LongRoPE (long prompts would run with the short factors)")
    factor = entry.get("factor")
    if rope_type in _FACTOR_ROPE_TYPES and factor is not None and \
            not (_is_number(factor) and factor >= 1):
        raise ValueError(f"model config {path!r}: {where}.factor={factor!r} is invalid "
                         f"for rope_type {rope_type!r}; it must be a number >= 1 (how "
                         "many times the original context the scaled RoPE covers)")


def _rope_type_field(entry: dict[str, Any], layer_type: str | None,
                     raw: dict[str, Any] | None) -> str:
    """The config.json field path of a RoPE entry's type, as the file writes it: an older
    ``rope_scaling`` (transformers 5 reads it as ``rope_parameters``) and its ``type`` key
    (transformers copies it to ``rope_type``), else ``rope_parameters[...].rope_type``."""
    if layer_type is not None:
        return f"rope_parameters[{layer_type!r}].rope_type"
    older = raw is not None and "rope_parameters" not in raw and \
        isinstance(raw.get("rope_scaling"), dict)
    key = "type" if entry.get("type") == entry.get("rope_type") and "type" in entry \
        else "rope_type"
    return f"{'rope_scaling' if older else 'rope_parameters'}.{key}"


def check_rope_positions(config: Any, path: str) -> None:
    """Check that the positions the model's RoPE table covers after scaling
    (:func:`~kvflow.layers.rope_parameters.rope_max_positions`: ``max_position_embeddings``
    times a linear or dynamic ``factor``, YaRN's original length times its ``factor``) are at
    most :data:`MAX_ROPE_POSITIONS`: the table is built at start-up with one row per
    position, so a corrupt ``factor`` (2**40) asked for petabytes.

    Raises:
        ValueError: naming ``path``, the positions and the fields they come from.
    """
    if getattr(config, "max_position_embeddings", None) is None:
        return  # no positions to table (a config check has refused a bad value)
    positions = rope_max_positions(config)
    if positions > MAX_ROPE_POSITIONS:
        raise ValueError(f"model config {path!r}: the RoPE scaling covers {positions} "
                         f"positions (max_position_embeddings="
                         f"{config.max_position_embeddings} with its rope_parameters "
                         f"factor), above the {MAX_ROPE_POSITIONS} positions kvflow tables (is "
                         "the factor right?)")
