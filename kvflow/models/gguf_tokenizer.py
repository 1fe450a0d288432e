"""A transformers tokenizer from a GGUF file's tokenizer metadata, cached on disk."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvflow.models.gguf_reader import read_gguf_metadata

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build a transformers (fast) tokenizer from the GGUF's tokenizer metadata.

    Uses ``AutoTokenizer.from_pretrained(dirname, gguf_file=basename)`` (a
    ``PreTrainedTokenizerFast``-style tokenizer; GGUF ``tokenizer.ggml.add_bos_token`` is
    honoured by transformers). The returned tokenizer has ``chat_template`` set from the GGUF
    key ``tokenizer.chat_template`` when transformers did not set it, and its bos/eos/pad
    tokens are made to match ``tokenizer.ggml.{bos,eos,padding}_token_id`` when present. The
    result is saved under the kvflow cache directory and reloaded from there next time (see
    ``_tokenizer_cache_dir``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid GGUF file.
    """
    meta = read_gguf_metadata(path)  # validates the file first (fast)
    from transformers import AutoTokenizer

    cached = _tokenizer_cache_dir(meta.path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # unreadable cache entry: rebuild it below
    directory, filename = os.path.split(os.path.abspath(meta.path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = str(template)
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and getattr(tokenizer, f"{attr}_id") != token_id:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if token is not None:
                setattr(tokenizer, attr, token)
    if cached is not None:
        _save_tokenizer_cache(tokenizer, cached)
    return tokenizer


def _tokenizer_cache_dir(path: str) -> str | None:
    """Cache folder for the tokenizer built from ``path``, keyed by the file's absolute path,
    size and mtime (None when the file cannot be stat'ed). transformers rebuilds a GGUF
    tokenizer through ``gguf.GGUFReader``, minutes for a 262k vocabulary (Gemma 3) on a small
    CPU; a saved ``tokenizer.json`` loads in about a second."""
    import hashlib

    from kvflow.config import cache_dir

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key).hexdigest()[:24])


def _save_tokenizer_cache(tokenizer: Any, folder: str) -> None:
    """Save into a temporary folder and rename it into place (best effort: a read-only cache
    only costs the next load its speed)."""
    import shutil
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
