"""A copy of a model or adapter folder with fields of one of its JSON files changed: how the
tests build a config.json / adapter_config.json that kvflow must refuse or read differently;
or with a tokenizer that puts a BOS first."""

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


def copy_with_bos(src: str, dst: Any) -> str:
    """Copy the model folder ``src`` to ``dst`` (must not exist) with its tokenizer putting
    ``<bos>`` (id 1) before every encoded text. Returns the new folder."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = shutil.copytree(src, str(dst))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer.save_pretrained(folder)
    return str(folder)
