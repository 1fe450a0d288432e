"""A model's sampling defaults from its ``generation_config.json`` (``--generation-config``).

The fields read are vLLM's (``ModelConfig.get_diff_sampling_param``): ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` and ``max_new_tokens`` (kvflow's ``max_tokens``). A request's own value
always wins (:meth:`kvflow.sampling_params.SamplingParams.with_defaults`; the server tells an
unset field from one set to the default value). ``do_sample`` is not read, as in vLLM: a
``temperature`` in the file applies even where transformers would decode greedily.

``eos_token_id`` (one id or a list: Llama 3 Instruct ends turns with ``<|eot_id|>`` and
``<|eom_id|>`` as well as ``<|end_of_text|>``) is read by :func:`load_eos_token_ids` whatever
``--generation-config`` says, as vLLM and transformers' ``generate`` do: every id stops
generation (see ``InputProcessor``). A value there that is not a token id or a list of them
is refused, naming the file; an id outside the vocabulary is kept, with a warning (it never
ends generation).
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
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
SAMPLING_DEFAULT_FIELDS = tuple(_FIELDS.values())  # the SamplingParams fields it can default


def load_sampling_defaults(source: ModelSource, mode: str = "auto",
                           overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams defaults the model's ``generation_config.json`` sets, with
    ``overrides`` (``--override-generation-config``: generation_config.json keys) over them.

    Args:
        source: the resolved model; only Hugging Face folders (``kind="hf"``) have the file.
        mode: ``"auto"`` reads the file, ``"none"`` ignores it (the overrides alone).
        overrides: values that replace the file's, key by key (vLLM merges them the same way).

    Returns:
        ``{SamplingParams field: value}`` for the keys the file sets (``null`` counts as
        unset); ``{}`` without a file.

    Raises:
        ValueError: the file is not a JSON object, or a value is invalid for its field (the
            message names the file and says ``--generation-config none`` ignores it), or an
            override invalid for its field.
    """
    defaults = _file_defaults(source, mode)
    if overrides:
        given = {_FIELDS[key]: value for key, value in overrides.items() if value is not None}
        try:
            SamplingParams(**given)
        except ValueError as e:
            raise ValueError(f"override_generation_config: {e}") from None
        defaults = {**defaults, **given}
        logger.warning("sampling defaults with --override-generation-config: %s", defaults)
    return defaults


def _file_defaults(source: ModelSource, mode: str) -> dict[str, Any]:
    """``load_sampling_defaults`` without the overrides."""
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


def _eos_ids(value: Any) -> list[int]:
    """An ``eos_token_id`` value (an int, a list of ints, or null) as a list; other entries
    are dropped (config.json's, read leniently)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if _is_token_id(v)]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _file_eos_ids(path: str, vocab_size: int | None) -> list[int]:
    """``eos_token_id`` of the generation_config.json at ``path`` as a list (``[]`` when the
    file, the key or its value is missing or null); with ``vocab_size``, logs a warning for an
    id outside ``[0, vocab_size)``: kept, as transformers' ``generate`` and vLLM keep it, but
    no generated token can be it, so it never ends generation (the other ids still do).

    Raises:
        ValueError: naming the file and the key, for a value that is not a token id or a list
            of token ids (a string, a float, a bool, or a list holding one): transformers'
            ``generate`` fails on it (TypeError) and vLLM stops on no token for it.
    """
    value = _read_json_object(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    bad = [v for v in values if not _is_token_id(v)]
    if bad:
        raise ValueError(f"{path!r}: eos_token_id must be a token id (an integer) or a list of "
                         f"token ids, not {value!r} ({bad[0]!r} is not an integer id); "
                         "transformers' generate fails on it: correct or remove the key")
    outside = [v for v in values if vocab_size is not None and not 0 <= v < vocab_size]
    if outside:
        logger.warning("%r: eos_token_id %s not a token id of the model (vocab_size %d): no "
                       "generated token can be it, so it never ends generation (transformers "
                       "and vLLM load it the same way)", path,
                       f"{outside} are" if len(outside) > 1 else f"{outside[0]} is", vocab_size)
    return values


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when the file is missing, unreadable or not an
    object (the sampling defaults report a bad generation_config.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_eos_token_ids(source: ModelSource, hf_config: Any = None,
                       vocab_size: int | None = None) -> list[int]:
    """Every token id that ends generation for this model: ``eos_token_id`` of its
    ``generation_config.json`` when the file sets it (what transformers' ``generate`` stops
    on), else the model config's (``hf_config``'s attribute, or the folder's config.json).

    Args:
        source: the resolved model (a GGUF file has no generation_config.json: its ids are
            llama.cpp's end-of-generation set, see ``gguf_tokenizer.gguf_eos_token_ids``).
        hf_config: the model's HF config when loaded; None reads config.json.
        vocab_size: the model's vocabulary size: a generation_config.json id outside it is
            named in a logged warning (it never ends generation; ``InputProcessor`` leaves it
            out of the stop ids). The front end passes it, once per engine.

    Returns:
        The ids in file order without repeats; ``[]`` when none is declared.

    Raises:
        ValueError: naming generation_config.json and ``eos_token_id``, when its value is
            neither null, a token id nor a list of token ids (see :func:`_file_eos_ids`).
    """
    if source.kind == "gguf":
        from kvflow.models.gguf_tokenizer import gguf_eos_token_ids

        return gguf_eos_token_ids(source.path)
    ids: list[int] = []
    if source.kind == "hf":
        ids = _file_eos_ids(os.path.join(source.path, GENERATION_CONFIG_FILE), vocab_size)
    if not ids and hf_config is not None:
        ids = _eos_ids(getattr(hf_config, "eos_token_id", None))
    elif not ids and source.kind == "hf":
        ids = _eos_ids(_read_json_object(os.path.join(source.path, "config.json"))
                       .get("eos_token_id"))
    return list(dict.fromkeys(ids))
