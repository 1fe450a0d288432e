"""A model's sampling defaults from its ``generation_config.json`` (``--generation-config``).

The fields read are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (kvflow's ``max_tokens``). A request's own value
always wins (:meth:`kvflow.sampling_params.SamplingParams.with_defaults`; the server tells an
unset field from one set to the default value). ``do_sample`` is not read, as in vLLM: a
``temperature`` in the file applies even where transformers would decode greedily.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kvflow.models.model_resolver import ModelSource
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SAMPLING_DEFAULT_FIELDS = tuple(_FIELDS.values())  # the SamplingParams fields it can default


def load_sampling_defaults(source: ModelSource, mode: str = "auto") -> dict[str, Any]:
    """The SamplingParams defaults the model's ``generation_config.json`` sets.

    Args:
        source: the resolved model; only Hugging Face folders (``kind="hf"``) have the file.
        mode: ``"auto"`` reads the file, ``"none"`` ignores it (returns ``{}``).

    Returns:
        ``{SamplingParams field: value}`` for the keys the file sets (``null`` counts as
        unset); ``{}`` without a file.

    Raises:
        ValueError: the file is not a JSON object, or a value is invalid for its field (the
            message names the file and says ``--generation-config none`` ignores it).
    """
    if mode == "none" or source.kind != "hf":
        return {}
    path = os.path.join(source.path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    ignore = "pass --generation-config none to ignore it"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path!r}: {e}; {ignore}") from None
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{path!r} is not a JSON object; {ignore}")
    defaults = {ours: data[theirs] for theirs, ours in _FIELDS.items()
                if data.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}; {ignore}") from None
    if defaults:
        logger.warning("sampling defaults from the model's %s (a request's own values win; "
                       "--generation-config none ignores them): %s", GENERATION_CONFIG_FILE,
                       defaults)
    return defaults
