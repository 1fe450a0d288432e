"""Checks of a model folder's config.json made before transformers reads it.

transformers fills a missing size with its class default (LlamaConfig: 4096 hidden, 32 layers)
and builds a config with zero or negative sizes, so such a file used to fail much later with a
message about something else: a checkpoint "lacking" layers 30-31, a pipeline-parallel size
exceeding "-1 layers", torch refusing a negative tensor dimension, or ``integer modulo by
zero``. Here each is one ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import json
from typing import Any

# every architecture kvflow serves describes its transformer with these
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# checked when present (null means "derive it", e.g. a Mistral config's head_dim)
OPTIONAL_SIZES = ("num_key_value_heads", "intermediate_size", "head_dim",
                  "max_position_embeddings")


def read_config_json(path: str) -> dict[str, Any]:
    """The parsed config.json at ``path``, its sizes checked (see :func:`check_config_sizes`).

    Raises:
        ValueError: naming ``path``: it cannot be read, is not valid JSON (with the line and
            column), is not a JSON object, or a size is missing or invalid.
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
    check_config_sizes(raw, path)
    return raw


def check_config_sizes(raw: dict[str, Any], path: str) -> None:
    """Check the transformer sizes of a parsed config.json: :data:`REQUIRED_SIZES` present and
    every size positive integers, and ``num_attention_heads`` a multiple of
    ``num_key_value_heads`` (grouped-query attention shares each KV head among a whole number
    of query heads). A vision-language config keeps them in ``text_config``; a size at the top
    level wins, as in :func:`kvflow.models.loader.hoist_text_config`.

    Raises:
        ValueError: naming ``path`` and the field, with its value and the reason.
    """
    text = raw.get("text_config")
    text = text if isinstance(text, dict) else {}
    sizes: dict[str, int] = {}
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = raw.get(name, text.get(name))
        if value is None:
            if name in REQUIRED_SIZES:
                raise ValueError(f"model config {path!r} has no {name!r}; kvflow needs it to "
                                 "build the model (is this a complete config.json?)")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model config {path!r}: {name}={value!r} is invalid; it must be "
                             "a positive integer")
        sizes[name] = value
    heads, kv_heads = sizes["num_attention_heads"], sizes.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"model config {path!r}: num_attention_heads={heads} is not a multiple "
                         f"of num_key_value_heads={kv_heads}")
