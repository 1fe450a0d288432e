"""The values of ``kvflow serve``'s options that take parsing (``--lora-modules`` entries, the
CORS word lists) and vLLM's ``--disable-log-stats``, checked for
:class:`~kvflow.config.server.ServerConfig`, and how its errors quote a refused value."""

from __future__ import annotations

import json
from typing import Any

from kvflow.config.options import json_object

LIST_FIELDS = ("allowed_origins", "allowed_methods", "allowed_headers")


def lora_module(module: Any) -> Any:
    """One ``--lora-modules`` entry as ``NAME=PATH``: vLLM's JSON form
    ``{"name": NAME, "path": PATH}`` (or a config file's mapping of those keys) is turned
    into it; another string is kept as given (the NAME=PATH check follows).

    Raises:
        ValueError: for an entry that is neither a string nor a mapping, a JSON entry that
            is not an object of a string ``name`` (without
            "=") and ``path``, or that holds another key (vLLM's ``base_model_name``: an
            adapter's base is always the served model here).
    """
    if isinstance(module, dict):  # a config file's mapping
        entry = module
    elif not isinstance(module, str):
        raise ValueError(f"lora_modules: {module!r} must be NAME=PATH or "  # noqa: TRY004
                         '{"name": NAME, "path": PATH}')
    elif not module.lstrip().startswith("{"):
        return module
    else:
        try:
            entry = json.loads(module)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules: {module!r} is not valid JSON ({e})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"lora_modules: {module!r} must be a JSON object")  # noqa: TRY004
    other = sorted(set(entry) - {"name", "path"})
    if other:
        raise ValueError(f"lora_modules: {module!r}: {', '.join(other)} is not supported "
                         "(kvflow reads name and path; an adapter's base model is the "
                         "served model)")
    name, path = entry.get("name"), entry.get("path")
    if not (isinstance(name, str) and name and "=" not in name and isinstance(path, str)
            and path):
        raise ValueError(f"lora_modules: {module!r} needs a non-empty string name (without "
                         "'=') and path")
    return f"{name}={path}"


def one_or_many(value: Any) -> tuple | None:
    """A flag that takes several values, as a tuple: a lone string (a config file's or a
    caller's one value) becomes a tuple of one, another iterable a tuple of its items; None
    stays None."""
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def shown_value(name: str, value: Any) -> str:
    """The value of option ``name`` as its error message quotes it: several values (a tuple)
    as the list they were typed as, and each non-blank ``api_key`` as ``'***'``, so that a
    refused ``--api-key KEY ""`` does not write its good key to the terminal or a log (the
    blank one at fault still shows)."""
    if name == "api_key" and isinstance(value, (list, tuple)):
        value = ["***" if isinstance(k, str) and k.strip() else k for k in value]
    return repr(list(value) if isinstance(value, tuple) else value)


def word_list(name: str, value: Any) -> tuple[str, ...] | None:
    """A CORS list flag's value as a tuple of strings: each word is one entry, or a JSON list
    of entries (vLLM's form, ``'["https://a.example"]'``); None stays None.

    Raises:
        ValueError: for a word that starts a JSON list but is not one of strings.
    """
    if value is None:
        return None
    words = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for word in words:
        if isinstance(word, str) and word.lstrip().startswith("["):
            try:
                items = json.loads(word)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}={word!r} is not a JSON list: {e}") from None
            if not all(isinstance(item, str) for item in items):
                raise ValueError(f"{name}={word!r} must be a list of strings")
            out += items
        elif isinstance(word, str):
            out.append(word)
        else:
            raise ValueError(f"{name}={value!r} must be strings")
    return tuple(out)


def check_disable_log_stats(value: bool | None) -> None:
    """vLLM's ``--disable-log-stats`` of the server (the offline ``LLM`` reads its
    ``disable_log_stats`` itself: False keeps the metrics ``get_metrics`` reads): True or
    unset is what kvflow does (it writes no periodic stats log line, vLLM's "Avg
    prompt throughput ..." one; /metrics is served either way).

    Raises:
        ValueError: for False (``--no-disable-log-stats``): asks for stats log lines kvflow
            does not write.
    """
    if value is False:
        raise ValueError("--no-disable-log-stats (disable_log_stats=False) is refused: kvflow "
                         "writes no periodic stats log line to turn on (its statistics are "
                         "GET /metrics and each RequestOutput's metrics); leave it out")


def structured_outputs_config(value: str | dict | None) -> dict[str, bool] | None:
    """``--structured-outputs-config`` as a dict: vLLM's JSON object, of which kvflow takes
    ``enable_in_reasoning`` (a bool) alone.

    Raises:
        ValueError: naming the setting, for text that is not a JSON object, another key
            (xgrammar is kvflow's only backend), or a value that is not a bool.
    """
    parsed = json_object("structured_outputs_config", value, '{"enable_in_reasoning": true}')
    if parsed is None:
        return None
    for key, item in parsed.items():
        if key != "enable_in_reasoning":
            raise ValueError(f"structured_outputs_config key {key!r} is not supported: "
                             "kvflow reads only enable_in_reasoning (xgrammar is its only "
                             "backend)")
        if not isinstance(item, bool):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"structured_outputs_config.enable_in_reasoning={item!r} must "
                "be true or false")
    return parsed
