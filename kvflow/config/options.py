"""Field helpers shared by the config sections: ``opt`` (a field with help text and choices),
value checks, byte sizes, and one CLI flag per field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import field, fields
from typing import Any


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with ``default`` and the metadata the CLI generator reads: ``help``
    and ``extra`` (``choices``, ``nargs``, ``metavar``, ``action`` such as "append" for a
    repeated flag, ``cli=False`` for fields kvflow sets
    itself, ``aliases``: further flags, e.g. vLLM's name for it)."""
    return field(default=default, metadata={"help": help, **extra})


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def json_object(name: str, value: Any, example: str) -> dict[str, Any] | None:
    """A JSON-object setting's value (a flag's JSON text, or a dict from Python or the config
    file) as a dict; None stays None.

    Raises:
        ValueError: naming ``name``, for text that is not JSON or JSON that is not an object
            (the message shows ``example``, a valid value).
    """
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}={value!r} is not a JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{name}={value!r} must be a JSON object, e.g. '{example}'")
    return parsed


def json_config_dict(name: str, value: Any, example: str) -> dict[str, Any] | None:
    """A JSON-object config section's value before its keys are checked: a dict as it is,
    a flag's JSON text parsed (the text ``null`` is None: the section off).

    Raises:
        ValueError: naming ``name``, for text that is not JSON, or a value that is not an
            object (the message shows ``example``, a valid object).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{name} must be a JSON object such as {example}")
    return value


def unknown_fields(cls: type, value: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The keys of ``value`` that dataclass ``cls`` has no field for, and its field names
    (both sorted), for a config section's refusal message."""
    known = {f.name for f in fields(cls)}
    return sorted(set(value) - known), sorted(known)


def parse_bytes(value: str | int) -> int:
    """Parse a memory size such as ``2GiB``, ``512MB`` or ``1073741824`` into bytes; vLLM's
    one-letter suffixes too (its ``--kv-cache-memory-bytes``): lower case decimal (``1g`` =
    10**9, ``25.6k`` = 25600), upper case binary and whole numbers only (``1G`` = 2**30).

    Raises:
        ValueError: if the string is not a positive number with an optional unit.
    """
    if isinstance(value, int):
        size = value
    elif re.fullmatch(r"\s*[0-9]+(?:\.[0-9]+)?[kmgtKMGT]\s*", str(value)):
        size = _vllm_size(str(value).strip())
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _BYTE_UNITS:
            raise ValueError(f"cannot parse memory size {value!r}: expected e.g. 2GiB, 512MB")
        size = int(float(m.group(1)) * _BYTE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    return size


def _vllm_size(text: str) -> int:
    """``text`` (a number and one of k m g t K M G T) in bytes, as vLLM reads it
    (:func:`human_readable_int`).

    Raises:
        ValueError: for a fraction with an upper-case (binary) suffix, which vLLM refuses.
    """
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"cannot parse memory size {e}") from None


def human_readable_int(value: str) -> int:
    """An integer flag's text as vLLM's ``human_readable_int`` reads it (its
    ``--max-num-batched-tokens``, ``--max-model-len``): a whole number (``2048``), or a
    number and one letter, lower case decimal (``2k`` = 2000, ``25.6k`` = 25600, ``1m``,
    ``1g``, ``1t``) or upper case binary with a whole number (``2K`` = 2048, ``1M`` = 2**20).

    Raises:
        argparse.ArgumentTypeError: for other text (argparse prints it after the flag's name),
            a fraction with a binary suffix saying to use the decimal one.
    """
    text = str(value).strip()
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?[kmgtKMGT]", text):
        number, suffix = text[:-1], text[-1]
        power = "kmgt".index(suffix.lower()) + 1
        if suffix.islower():
            return int(float(number) * 1000**power)
        if number.isdigit():
            return int(number) * 1024**power
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
            f"{number}{suffix.lower()} (decimal)?")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an integer: give e.g. 2048, 2k (2000) or 2K (2048)") from None


def human_readable_int_or_auto(value: str) -> int:
    """:func:`human_readable_int`, and vLLM's ``-1`` / ``auto`` (any case) as -1 (its
    ``--max-model-len``: the model's length, fitted to the KV cache). Raises
    argparse.ArgumentTypeError as :func:`human_readable_int`."""
    if str(value).strip() == "-1" or str(value).strip().lower() == "auto":
        return -1
    return human_readable_int(value)


def parse_gib_or_bytes(value: str | float) -> int:
    """Parse a memory size given as vLLM's ``--swap-space`` takes it: a bare number (``4``,
    ``0.5``, ``"8"``) is GiB, as in vLLM; a size with a unit (``4GiB``, ``512MiB``) is read
    by :func:`parse_bytes`.

    Returns:
        The size in bytes.

    Raises:
        ValueError: if the value is not a positive number with an optional unit.
    """
    if isinstance(value, int | float) or re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", str(value)):
        size = int(float(value) * 2**30)
        if size <= 0:
            raise ValueError(f"memory size {value!r} must be positive")
        return size
    return parse_bytes(value)


def _has_type(value: Any, type_name: str) -> bool:
    """Whether ``value`` fits one name of a field's annotation ("int", "float", ...); names
    this check does not know pass."""
    if type_name == "None":
        return value is None
    if type_name in ("int", "float") and isinstance(value, bool):
        return False
    known = {"int": int, "float": (int, float), "str": str, "bool": bool}
    return type_name not in known or isinstance(value, known[type_name])


def check_choices(config: Any) -> None:
    """Raise ValueError for a field value of the wrong type (by the field's annotation, e.g.
    ``max_num_seqs=1.5``) or outside the field's declared ``choices``."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        type_names = [t.strip() for t in str(f.type).split("|")]
        if not any(_has_type(value, t) for t in type_names):
            raise ValueError(f"{f.name}={value!r} is invalid; it must be "
                             f"{' or '.join(type_names)}")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name}={value!r} is invalid; choose one of {choices}")


def add_field_arg(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    """Add ``--field-name`` for config field ``f`` to ``group`` (booleans get ``--no-`` forms;
    int/float annotations parse as such, or with the metadata's ``type``, e.g.
    :func:`human_readable_int`; ``choices``, ``nargs``, ``const``, ``metavar``,
    ``action`` and ``aliases``,
    further flag names, from the metadata)."""
    if not f.metadata.get("cli", True):  # set by kvflow itself, not a user flag
        return
    meta = f.metadata
    flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
    if f.type in ("bool", bool, "bool | None"):
        group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=meta.get("help"))
        return
    kind = meta.get("type") or {"int": int, "int | None": int, "float": float,
                                "float | None": float}.get(str(f.type), str)
    choices = meta.get("choices")  # None (unset) is the default, not a value one can type
    choices = None if choices is None else [c for c in choices if c is not None]
    group.add_argument(*flags, dest=f.name, type=kind, default=f.default, choices=choices,
                       **{k: meta[k] for k in ("nargs", "const", "metavar", "action")
                          if k in meta},
                       help=meta.get("help") if "default" in str(meta.get("help"))
                       else f"{meta.get('help')} (default: {f.default})")
