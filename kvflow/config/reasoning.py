"""vLLM 0.32's reasoning markers as strings (``ReasoningConfig``): each reasoning parser's
(:data:`PARSER_MARKERS`, the table the server's ``--reasoning-parser`` classes in
``kvflow/entrypoints/tool_parsers/reasoning.py`` agree with) and vLLM's ``reasoning_config``
(``{"reasoning_start_str": ..., "reasoning_end_str": ...}``), whose strings win over the
parser's (``ReasoningConfig.initialize_token_ids``). ``kvflow.sampling.reasoning_markers`` tokenizes
them.
"""

from __future__ import annotations

from typing import Any

from kvflow.config.options import json_object

#: each reasoning parser's (start, end) markers; None for a parser whose vLLM namesake names
#: none (vLLM then refuses a budget)
PARSER_MARKERS: dict[str, tuple[str, str] | None] = {
    **dict.fromkeys(("think", "deepseek_r1", "qwen3", "glm45", "ernie45", "deepseek_v3",
                     "step3"), ("<think>", "</think>")),
    "mistral": ("[THINK]", "[/THINK]"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "granite": None,
    "hunyuan_a13b": None,
}

#: vLLM's ``reasoning_config`` keys
REASONING_CONFIG_KEYS = ("reasoning_start_str", "reasoning_end_str")

#: the reasoning keywords of ``LLM(...)`` and ``AsyncLLM(...)`` (``kvflow.inputs.reasoning``),
#: which are not ``EngineConfig`` fields
REASONING_OPTIONS = ("reasoning_parser", "reasoning_config", "structured_outputs_config")


def check_reasoning_parser(name: Any) -> str | None:
    """``name`` as a reasoning parser's name (None: none).

    Raises:
        ValueError: naming ``reasoning_parser`` for an unknown name, listing the choices.
    """
    if name is None or (isinstance(name, str) and name in PARSER_MARKERS):
        return name
    raise ValueError(f"reasoning_parser={name!r} is unknown; choose one of "
                     f"{sorted(PARSER_MARKERS)} (or None)")


def reasoning_config(value: Any) -> dict[str, str] | None:
    """vLLM's ``reasoning_config`` (a dict, or its JSON text) checked: its keys among
    :data:`REASONING_CONFIG_KEYS`, each value a string (``""``: unset, vLLM's default);
    None stays None.

    Raises:
        ValueError: naming ``reasoning_config`` or the key, for text that is not a JSON
            object, another key, or a value that is not a string.
    """
    parsed = json_object("reasoning_config", value,
                         '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}')
    if parsed is None:
        return None
    for key, item in parsed.items():
        if key not in REASONING_CONFIG_KEYS:
            raise ValueError(f"reasoning_config key {key!r} is not supported: kvflow reads "
                             f"{' and '.join(REASONING_CONFIG_KEYS)}")
        if not isinstance(item, str):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"reasoning_config.{key}={item!r} must be a string (the marker's text)")
    return {k: v for k, v in parsed.items() if v}


def marker_strings(parser: str | None, config: dict[str, str] | None
                   ) -> tuple[str, str] | None:
    """The (start, end) marker strings: ``config``'s where it sets them, the parser's
    otherwise (vLLM's order); None when neither names both.

    Raises:
        ValueError: for a ``config`` that sets one marker when nothing gives the other
            (vLLM would silently leave the budget off), naming the missing key.
    """
    config = config or {}
    named = PARSER_MARKERS.get(parser) if parser is not None else None
    start = config.get("reasoning_start_str") or (named[0] if named else None)
    end = config.get("reasoning_end_str") or (named[1] if named else None)
    if start and end:
        return start, end
    if config:
        missing = REASONING_CONFIG_KEYS[0] if not start else REASONING_CONFIG_KEYS[1]
        raise ValueError(f"reasoning_config needs {missing} too (reasoning_parser={parser!r} "
                         "names no marker to take it from)")
    return None
