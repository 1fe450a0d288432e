"""A model folder's tokenizer files, read to say in their terms why transformers could not
build a tokenizer from them (``loader.load_tokenizer``)."""

from __future__ import annotations

import json
import os

# the files a transformers tokenizer is built from (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json")


def tokenizer_files_problem(folder: str) -> str | None:
    """Why a folder's tokenizer failed to load, said in terms of its files: one of its JSON
    files cannot be read, is not valid JSON (a truncated copy) or not a JSON object, its
    ``tokenizer.json`` has no ``model``, or it has no tokenizer file at all; None when none of
    these. transformers says a truncated file as a bare "Expecting value:
    line 97580 column 6" and a missing one as "Couldn't instantiate the backend tokenizer" with
    a hint to install sentencepiece."""
    for name in TOKENIZER_JSON_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as e:
                return f"{path!r} cannot be read: {e.strerror or e}"
            except (UnicodeDecodeError, ValueError) as e:
                return f"{path!r} is not valid JSON, truncated or corrupt ({e})"
            if not isinstance(data, dict):
                return f"{path!r} is not a JSON object (it is a {type(data).__name__})"
            if name == "tokenizer.json" and not isinstance(data.get("model"), dict):
                return (f"{path!r} has no \"model\" object (the tokenizer's vocabulary and "
                        "algorithm): not a whole tokenizers file")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        return f"the folder has no tokenizer file (one of {', '.join(TOKENIZER_FILES)})"
    return None
