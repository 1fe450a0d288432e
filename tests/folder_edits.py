"""A copy of a model or adapter folder with fields of one of its JSON files changed: how the
tests build a config.json / adapter_config.json that kvflow must refuse or read differently."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any


def copy_with_json(src: str, dst: Any, name: str = "config.json", **changes: Any) -> str:
    """Copy the folder ``src`` to ``dst`` (must not exist) and merge ``changes`` into its JSON
    file ``name`` (top-level keys; a value replaces the old one). Returns that file's path."""
    path = os.path.join(shutil.copytree(src, str(dst)), name)
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)
    return path
