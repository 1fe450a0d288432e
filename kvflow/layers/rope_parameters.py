"""What a model's HF config says about its RoPE, read as transformers 5 reads it: theta and
the scaling dict (:func:`get_rope_parameters`), the positions the table covers
(:func:`rope_max_positions`, or more once :func:`extend_rope_positions` extended it; in words,
:func:`rope_positions_source`), the rotated dimensions and LongRoPE's attention factor. The
tables themselves are built in :mod:`kvflow.layers.rotary`."""

from __future__ import annotations

import math
from typing import Any

# the config attribute :func:`extend_rope_positions` sets: positions the table covers beyond
# what the config's own fields give (an EAGLE head reads every position of its target)
EXTENDED_ROPE_POSITIONS = "kvflow_extended_rope_positions"

# The most positions a model's RoPE (or position-embedding) table may cover, after scaling:
# 16M, above any released model's context (Llama 4 Scout: 10M); a corrupt config beyond it
# would ask for a table that does not fit in memory (2**40 positions: terabytes). GGUF
# metadata is held to the same limit (kvflow.models.gguf_rope_scaling imports this one).
MAX_ROPE_POSITIONS = 1 << 24

# the ``rope_type`` values kvflow's RoPE tables implement (:mod:`kvflow.layers.rotary`; ``su`` is
# older Phi-3 configs' name of ``longrope``); config.json is checked against them at load
# (``models.hf_config_checks.check_rope_parameters``)
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn", "dynamic")


def get_rope_parameters(config: Any) -> tuple[float, dict | None]:
    """Read (rope_theta, rope_scaling) from an HF config of any transformers version.

    transformers 5 stores ``rope_parameters = {"rope_type", "rope_theta", ...}``; older versions
    use a top-level ``rope_theta`` and an optional ``rope_scaling`` dict. Returns scaling None
    for plain RoPE.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dict (Gemma 3): take the full-attention entry.
        params = params.get("full_attention", next(iter(params.values())))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    scaling = dict(params) if params else dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    if rope_type in ("longrope", "su"):  # older Phi-3 configs keep the length at top level
        scaling.setdefault("original_max_position_embeddings",
                           getattr(config, "original_max_position_embeddings", None))
    if rope_type in ("yarn", "dynamic"):
        _fill_length_defaults(scaling, config)
    return float(theta), scaling


def _fill_length_defaults(scaling: dict, config: Any) -> None:
    """The lengths YaRN and dynamic NTK scale from, as transformers 5 reads them. YaRN:
    ``original_max_position_embeddings`` from the rope dict, else the config's top-level
    field, else ``max_position_embeddings``; a missing ``factor`` is
    ``max_position_embeddings / original``. Dynamic: always ``max_position_embeddings``."""
    max_positions = getattr(config, "max_position_embeddings", None)
    if scaling["rope_type"] == "dynamic":
        scaling["original_max_position_embeddings"] = max_positions
        return
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = \
            getattr(config, "original_max_position_embeddings", None) or max_positions
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]


def rope_max_positions(config: Any) -> int:
    """Positions the model's RoPE covers (the rotary table's length and the longest
    ``max_model_len``): ``max_position_embeddings``, except for YaRN,
    ``max(max_position_embeddings, original_max_position_embeddings x factor)``, and dynamic
    NTK and linear scaling, ``max_position_embeddings x factor`` (vLLM's rule; transformers
    itself has no limit), but for Gemma 3, whose ``max_position_embeddings`` already gives
    the linearly scaled length (vLLM exempts it too); or more where
    :func:`extend_rope_positions` extended the table.
    """
    return max(_scaled_positions(config), getattr(config, EXTENDED_ROPE_POSITIONS, None) or 0)


def rope_positions_source(config: Any) -> str:
    """Where :func:`rope_max_positions` comes from, in words for an error message: the
    config's ``max_position_embeddings``, or the product its RoPE scaling stretches it to
    (YaRN: ``original_max_position_embeddings x factor``; dynamic NTK and linear:
    ``max_position_embeddings x factor``), or a table extended past both."""
    base = int(config.max_position_embeddings)
    positions = rope_max_positions(config)
    if positions == base:
        return "the model's max_position_embeddings"
    _, scaling = get_rope_parameters(config)
    rope_type = (scaling or {}).get("rope_type")
    if positions != _scaled_positions(config) or rope_type is None:
        return f"the rotary table extended past max_position_embeddings {base}"
    stretched = scaling["original_max_position_embeddings"] if rope_type == "yarn" else base
    field = "original_max_position_embeddings" if rope_type == "yarn" else \
        "max_position_embeddings"
    return f"{field} {stretched} x factor {scaling.get('factor')} of its {rope_type} RoPE scaling"


def _scaled_positions(config: Any) -> int:
    """:func:`rope_max_positions` from the config's own fields (no extension)."""
    positions = int(config.max_position_embeddings)
    _, scaling = get_rope_parameters(config)
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "yarn":
        scaled = scaling["original_max_position_embeddings"] * scaling["factor"]
        return max(positions, int(scaled))
    if rope_type == "dynamic" or (rope_type == "linear" and not _is_gemma3(config)):
        return int(positions * (scaling.get("factor") or 1.0))
    return positions


def extend_rope_positions(config: Any, positions: int) -> None:
    """Make the RoPE table of a model built from ``config`` cover at least ``positions``
    positions, in place, without changing the rotation of any position it covered: the
    config's ``max_position_embeddings`` is kept (dynamic NTK's original length and
    LongRoPE's attention factor derive from it; YaRN's, where transformers has not written it
    into the rope dict), the table length is set apart
    (``EXTENDED_ROPE_POSITIONS``, read by :func:`rope_max_positions`), and a LongRoPE
    attention factor derived from the table length is written down first."""
    if _scaled_positions(config) >= positions:
        return
    _, scaling = get_rope_parameters(config)
    if (scaling or {}).get("rope_type") in ("longrope", "su") and \
            scaling.get("attention_factor") is None:
        factor = longrope_attention_factor(scaling, rope_max_positions(config))
        params = getattr(config, "rope_parameters", None)
        target = params if isinstance(params, dict) and params else config.rope_scaling
        target["attention_factor"] = factor
    setattr(config, EXTENDED_ROPE_POSITIONS, int(positions))


def _is_gemma3(config: Any) -> bool:
    """Gemma 3 (text or multimodal), whose context length is given already scaled."""
    return "gemma3" in str(getattr(config, "model_type", ""))


def get_rotary_dim(config: Any, head_dim: int) -> int:
    """Rotated dimensions per head: ``head_dim x partial_rotary_factor`` (transformers 5 keeps
    the factor in ``rope_parameters``, older versions at top level; default 1)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor or getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def longrope_attention_factor(scaling: dict, max_position: int) -> float:
    """LongRoPE's magnitude correction of cos/sin: ``attention_factor`` if given, else
    ``sqrt(1 + ln(s) / ln(L_orig))`` with ``s = max_position / L_orig`` (1 when ``s <= 1``)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
