"""Checks of text that enters kvflow from outside (pure functions, no kvflow imports).

A JSON string may carry a lone UTF-16 surrogate (``"\\ud800"``): Python decodes it into a
``str`` that cannot be encoded as UTF-8, so tokenizers and templates fail deep inside with an
unhelpful error. Every text field a client sends is checked at the edge instead.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["check_text", "find_lone_surrogate"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """Find the first string inside ``value`` (str, or dicts / lists / tuples of them, keys
    included) that holds a lone surrogate.

    Returns:
        ``(path, message)``: the dotted path to it (``messages.0.content``; ``path`` is the
        prefix) and a message saying which code point at which offset; None when all text is
        valid Unicode.
    """
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        if match is None:
            return None
        return path, (f"contains a lone UTF-16 surrogate U+{ord(match.group()):04X} at "
                      f"character {match.start()}; text must be valid Unicode")
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        if _SCALARS.issuperset(map(type, value)):  # token ids: no text (C speed, no loop)
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        sub = f"{path}.{key}" if path else str(key)
        found = find_lone_surrogate(key, sub) if isinstance(key, str) else None
        found = found or find_lone_surrogate(item, sub)
        if found:
            return found
    return None


def check_text(value: Any, name: str) -> None:
    """Raises ValueError naming ``name`` (and the path inside it) if any string in ``value``
    holds a lone surrogate; see ``find_lone_surrogate``."""
    found = find_lone_surrogate(value, name)
    if found is not None:
        raise ValueError(f"{found[0]} {found[1]}")
