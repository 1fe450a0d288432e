"""SharedStorageConnector's block keys: the name under which a block's K/V is stored, the
same for every engine whose K/V for that block would be the same.

Keys: the key of block ``i`` is a SHA-256 chain over everything its K/V depends on:
``key_i = sha256(key_{i-1} || int64 tokens of block i || repr(extra_i))``, starting from a digest of
the model's identity (``model_identity``: its effective config, dtype, quantization and
weight files), the block size and the KV-cache dtype. ``extra_i`` is the block's extra key
as the prefix cache builds it for vLLM's hashes (``core/block_hashing.py``
``connector_extra_keys``, handed in by the engine): the LoRA adapter's name and folder, each image overlapping the
block (its content digest and offset), the ``cache_salt`` on block 0, the prompt
embeddings' digest, a prompt past a LongRoPE model's original context. So a block is shared by every request with the same
tokens, adapter, images and salt up to its end (a prefix), and another model, another cache
layout, another adapter or image, never matches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["block_keys", "model_identity"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 1 << 20  # each weight file's head and tail, read whole
# and windows evenly spaced between them: a tensor of more than 1/_NUM_WINDOWS of its file
# holds one (a fine-tune that leaves the first and last tensors alone, e.g. embeddings and
# one layer's last projection, changes one of them)
_NUM_WINDOWS = 256
_WINDOW_BYTES = 4096


def model_identity(path: str, hf_config: Any, dtype: torch.dtype | None,
                   model_config: Any) -> str:
    """A hex SHA-256 naming the model whose K/V an engine computes: its effective config
    (``config.json`` after ``hf_overrides``, without the path or transformers version), the
    compute dtype, the quantization settings, and each weight file's name, size and first
    and last MiB and 256 windows of 4 KiB evenly spaced between them (two copies of a
    checkpoint match on any machine; a checkpoint of the same shapes with other weights in
    any tensor of more than 1/256 of its file does not: ``_sample_file``).
    ``load_format="dummy"`` names its seed instead.

    Args:
        path: the model's folder, or its ``.gguf`` file.
        hf_config: the transformers config the engine runs.
        dtype: the compute dtype; None for a digest of the model whatever its dtype (the
            folder of its layout records, ``storage_layouts.py``).
        model_config: the engine's ``ModelConfig`` (quantization, load format, seed).
    """
    config = {k: v for k, v in hf_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    mc = model_config
    # safetensors (vLLM's) reads the same files as auto: the same model, the same keys
    load_format = "auto" if mc.load_format == "safetensors" else mc.load_format
    digest.update(repr((str(dtype), mc.quantization, mc.quantization_group_size,
                        load_format, mc.seed if load_format == "dummy" else None)).encode())
    if mc.load_format != "dummy":
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(_WEIGHT_SUFFIXES))
        for file in files:
            _sample_file(digest, file)
    return digest.hexdigest()


def _sample_file(digest: Any, file: str) -> None:
    """Add weight file ``file`` to ``digest``: its name and size, its first and last MiB,
    and ``_NUM_WINDOWS`` windows of ``_WINDOW_BYTES`` evenly spaced between them (about
    3 MiB read per file, mostly from the page cache the weights were just loaded through;
    256 seeks, not more, for a file the engine does not load on slow network storage)."""
    size = os.path.getsize(file)
    digest.update(f"|{os.path.basename(file)}|{size}|".encode())
    with open(file, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        middle = size - 2 * _SAMPLE_BYTES - _WINDOW_BYTES
        if middle > 0:
            for i in range(_NUM_WINDOWS):
                f.seek(_SAMPLE_BYTES + middle * i // (_NUM_WINDOWS - 1))
                digest.update(f.read(_WINDOW_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))


def block_keys(tokens: Sequence[int], block_size: int, kv_cache_dtype: str,
               model_key: str = "",
               extra_key: Callable[[int, int], Any] | None = None) -> list[str]:
    """The storage keys (64 hex digits) of the full blocks of ``tokens`` (see the module).

    Args:
        tokens: the token ids (a partial last block gets no key).
        block_size: tokens per block.
        kv_cache_dtype: the cache's dtype setting.
        model_key: ``model_identity`` of the engine.
        extra_key: ``(start, end)`` -> the extra key of the block of positions
            ``[start, end)`` (None, or nested tuples of str and int: hashed by ``repr``), or
            None for none.
    """
    seed = f"kvflow-shared-storage-v2|{model_key}|{block_size}|{kv_cache_dtype}"
    parent = hashlib.sha256(seed.encode()).digest()
    ids = np.asarray(tokens[:len(tokens) // block_size * block_size], dtype="<i8")
    keys = []
    for i in range(len(ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        extra = None if extra_key is None else extra_key(start, end)
        parent = hashlib.sha256(parent + ids[start:end].tobytes() + repr(extra).encode()
                                ).digest()
        keys.append(parent.hex())
    return keys
