"""SharedStorageConnector's files in its folder: the path of a stored block (one file, or one
per tensor-parallel rank), whether a block is stored, and the folder made at start-up.
Standard library only; it imports nothing of its package (whose ``__init__`` imports
``shared_storage``, which imports this)."""

from __future__ import annotations

import os


def block_path(root: str, key: str, rank: int = 0, tp_size: int = 1) -> str:
    """The file of the block stored under ``key``: ``{key}.safetensors``, or under tensor
    parallelism the file of tensor-parallel rank ``rank`` of ``tp_size`` (its KV heads),
    ``{key}.tp{tp_size}_rank{rank}.safetensors``."""
    name = key if tp_size == 1 else f"{key}.tp{tp_size}_rank{rank}"
    return os.path.join(root, f"{name}.safetensors")


def is_stored(root: str, key: str, tp_size: int = 1) -> bool:
    """Whether every tensor-parallel rank's file of block ``key`` is in ``root``."""
    return all(os.path.exists(block_path(root, key, rank, tp_size)) for rank in range(tp_size))


def make_folder(root: str) -> None:
    """Create the storage folder ``root`` if missing.

    Raises:
        ValueError: naming ``shared_storage_path`` and the OS error, if it cannot be created
            (a missing parent on a read-only file system, a file in the way, no permission),
            so start-up fails with the setting's name rather than a bare OSError.
    """
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_transfer_config kv_connector_extra_config shared_storage_path="
                         f"{root!r} cannot be created: {e.strerror or e}") from None

