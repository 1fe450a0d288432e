"""A GGUF file's RoPE scaling as transformers' ``rope_scaling``: from its
``{arch}.rope.scaling.*`` metadata keys (``linear``, ``yarn``), or a Llama 3.1+ file's
``rope_freqs`` tensor (``llama3``, :mod:`kvflow.models.gguf_rope_factors`), held to
:data:`MAX_ROPE_POSITIONS` (:func:`kvflow.models.gguf_config.load_gguf_config`'s)."""

from __future__ import annotations

import math
from typing import Any

from kvflow.layers.rope_parameters import MAX_ROPE_POSITIONS
from kvflow.models.gguf_checks import ArchKeys
from kvflow.models.gguf_reader import GGUFTensorInfo
from kvflow.models.gguf_rope_factors import ROPE_FREQS, llama3_rope_scaling

__all__ = ["MAX_ROPE_POSITIONS", "gguf_rope_scaling"]



def gguf_rope_scaling(keys: ArchKeys, tensors: dict[str, GGUFTensorInfo],
                      kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The file's ``rope_scaling`` (None for none): the ``rope.scaling.*`` keys' (see
    :func:`_metadata_scaling`), or the ``rope_freqs`` tensor's (:func:`_rope_freqs_scaling`;
    ``kwargs``: the config's fields so far, ``head_dim`` read).

    Raises:
        ValueError: naming the file and the key or tensor kvflow cannot apply.
    """
    rope_scaling = _metadata_scaling(keys)
    if ROPE_FREQS in tensors:
        rope_scaling = _rope_freqs_scaling(keys, tensors[ROPE_FREQS], kwargs, rope_scaling)
    return rope_scaling


# rope.scaling.yarn_* keys -> the transformers YaRN field each one was converted from
# (llama.cpp's convert_hf_to_gguf.py writes beta_fast / beta_slow / attention_factor as they are).
_YARN_KEYS = (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
              ("yarn_attn_factor", "attention_factor"))


def _metadata_scaling(keys: ArchKeys) -> dict[str, Any] | None:
    """The transformers ``rope_scaling`` dict of ``rope.scaling.*``: ``linear`` (``factor``) or
    ``yarn`` (``factor``, ``original_max_position_embeddings`` from ``original_context_length``,
    and ``beta_fast``, ``beta_slow``, ``attention_factor`` from ``yarn_beta_fast``,
    ``yarn_beta_slow``, ``yarn_attn_factor``, as the checkpoint's config.json had them).

    Raises:
        ValueError: naming the key, for a missing or out-of-range ``factor`` (see
            :func:`_scaling_factor`), another scaling type (LongRoPE's
            factors are tensors kvflow does not read), a ``yarn_ext_factor`` other than 1
            (transformers' YaRN always extrapolates fully), a non-zero ``yarn_log_multiplier``
            (DeepSeek's softmax scale) or an ``attn_factor`` other than 1.
    """
    if keys.get("rope.scaling.attn_factor", 1.0) != 1.0:
        raise keys.error("rope.scaling.attn_factor", f"is {keys.get('rope.scaling.attn_factor')}"
                         ": a RoPE attention factor is not supported")
    scaling_type = keys.get("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise keys.error("rope.scaling.type", f"is {scaling_type!r}: kvflow maps 'none', "
                         "'linear' and 'yarn' RoPE scaling of GGUF files")
    if keys.get("rope.scaling.factor") is None:  # transformers raised a bare KeyError
        raise keys.error("rope.scaling.factor", f"is missing (rope.scaling.type is "
                         f"{scaling_type!r})")
    rope_scaling: dict[str, Any] = {"rope_type": scaling_type,
                                    "factor": _scaling_factor(keys)}
    if keys.get("rope.scaling.original_context_length") is not None:
        rope_scaling["original_max_position_embeddings"] = keys.int(
            "rope.scaling.original_context_length")
    if scaling_type == "yarn":
        rope_scaling.update(_yarn_fields(keys))
    return rope_scaling


def _scaling_factor(keys: ArchKeys) -> float:
    """``rope.scaling.factor``, checked against the range transformers' RoPE validation accepts
    (``factor >= 1``) and :data:`MAX_ROPE_POSITIONS` over the context it scales
    (``rope.scaling.original_context_length``, else ``context_length``, default 2048): YaRN
    sizes the rotary table as context x factor.

    Raises:
        ValueError: naming the key and the accepted range, for a factor that is not a number,
            not finite, below 1 or above that limit.
    """
    value = keys.get("rope.scaling.factor")
    context = keys.get("rope.scaling.original_context_length") or keys.get("context_length") \
        or 2048
    limit = MAX_ROPE_POSITIONS // context if isinstance(context, int) and context > 0 else 1
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or not 1 <= value <= limit:
        raise keys.error("rope.scaling.factor", f"is {value!r}; accepted: 1 <= factor <= {limit} "
                         f"(transformers requires >= 1; context {context} x factor may cover at "
                         f"most {MAX_ROPE_POSITIONS} RoPE positions)")
    return float(value)


def _yarn_fields(keys: ArchKeys) -> dict[str, float]:
    """transformers' YaRN fields from the ``rope.scaling.yarn_*`` keys (see :func:`_metadata_scaling`)."""
    ext = keys.get("rope.scaling.yarn_ext_factor")
    if ext is not None and ext != 1.0:
        raise keys.error("rope.scaling.yarn_ext_factor", f"is {ext}: only 1 (full YaRN "
                         "extrapolation, as transformers computes it) is supported")
    if keys.get("rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
        raise keys.error("rope.scaling.yarn_log_multiplier", "is "
                         f"{keys.get('rope.scaling.yarn_log_multiplier')}: a YaRN log "
                         "multiplier (DeepSeek-V2's mscale) is not supported")
    return {hf: keys.float(f"rope.scaling.{suffix}", 1.0) for suffix, hf in _YARN_KEYS
            if keys.get(f"rope.scaling.{suffix}") is not None}


def _rope_freqs_scaling(keys: ArchKeys, info: GGUFTensorInfo, kwargs: dict[str, Any],
                        rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``llama3`` RoPE scaling of a Llama 3.1+ file's ``rope_freqs`` tensor (see
    :mod:`kvflow.models.gguf_rope_factors`), None for divisors that are all 1.

    Raises:
        ValueError: naming the file and the tensor, for an architecture other than ``llama``
            (llama.cpp writes the tensor for Llama 3.1's scaling only), beside a
            ``rope.scaling.type`` scaling, or for divisors no llama3 scaling gives.
    """
    if keys.arch != "llama" or "num_local_experts" in kwargs or rope_scaling is not None:
        beside = (f" beside {keys.arch}.rope.scaling.type {rope_scaling['rope_type']!r}"
                  if rope_scaling is not None else "")
        raise ValueError(f"{keys.meta.path!r}: GGUF tensor {ROPE_FREQS!r} (Llama 3.1-style "
                         f"RoPE divisors){beside} is read for dense 'llama' files only")
    return llama3_rope_scaling(keys.meta, info, kwargs["head_dim"],
                               keys.float("rope.freq_base", 10000.0))
