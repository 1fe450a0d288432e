"""SharedStorageConnector's layout records: which KV layouts (compute dtype, block size,
KV-cache dtype, tensor-parallel size) of a model the producers of a folder store, so that a
consumer of another layout, which can never load their blocks (its keys and files differ),
says so instead of silently computing every prompt.

Each producing engine (``kv_producer``, ``kv_both``) records its layout at start-up as an
empty file ``{shared_storage_path}/.kvflow-layouts/{family_key}/{layout}``: ``family_key``
is ``model_identity`` of the model without its dtype, ``layout`` reads
``dtype=bfloat16,block_size=16,kv_cache_dtype=auto,tensor_parallel_size=1``
(``layout_name``). Records are never deleted (a producer of an old layout leaves its
record, as it leaves its blocks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["StorageLayout", "foreign_layouts", "layout_name", "mismatch_message",
           "record_layout"]

LAYOUTS_FOLDER = ".kvflow-layouts"


@dataclass(frozen=True)
class StorageLayout:
    """An engine's layout record: ``family_key`` (the folder of its model's records) and
    ``name`` (``layout_name``)."""

    family_key: str
    name: str


def layout_name(block_size: int, kv_cache_dtype: str, tp_size: int,
                dtype: str | None = None) -> str:
    """The record name of a layout: ``dtype=X,block_size=B,kv_cache_dtype=D,
    tensor_parallel_size=T`` (the settings as the command line names them; ``dtype`` the
    compute dtype, e.g. ``bfloat16``, left out when None)."""
    head = "" if dtype is None else f"dtype={dtype},"
    return (f"{head}block_size={block_size},kv_cache_dtype={kv_cache_dtype},"
            f"tensor_parallel_size={tp_size}")


def _folder(root: str, family_key: str) -> str:
    return os.path.join(root, LAYOUTS_FOLDER, family_key or "-")


def record_layout(root: str, layout: StorageLayout) -> None:
    """Record that an engine stores blocks of ``layout`` in ``root``.

    Raises:
        ValueError: naming ``shared_storage_path`` and the OS error, if the record cannot be
            written (no permission, a read-only folder).
    """
    folder = _folder(root, layout.family_key)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, layout.name), "a"):
            pass
    except OSError as e:
        raise ValueError(f"kv_transfer_config kv_connector_extra_config shared_storage_path="
                         f"{root!r}: this producer cannot record its KV layout in "
                         f"{folder}: {e.strerror or e}") from None


def foreign_layouts(root: str, layout: StorageLayout) -> list[str]:
    """The layouts the producers of ``layout``'s model recorded in ``root``, sorted, when
    none of them is ``layout`` (so none of their blocks is ever found by an engine of
    ``layout``); else (``layout`` among them, or none recorded) an empty list."""
    try:
        recorded = sorted(os.listdir(_folder(root, layout.family_key)))
    except OSError:  # no producer of this model recorded one (or the folder is unreadable)
        return []
    return [] if layout.name in recorded else recorded


def mismatch_message(root: str, layout: StorageLayout, recorded: list[str]) -> str:
    """What a consumer of ``layout`` says when the producers of its model in ``root`` store
    only ``recorded`` layouts."""
    return (f"kv_transfer_config: the producers of this model in shared_storage_path="
            f"{root!r} store KV blocks of {' / '.join(recorded)}; this engine's KV cache is "
            f"{layout.name}, so it can load none of them (every prompt is computed): start it "
            "with the producers' --dtype, --block-size, --kv-cache-dtype and "
            "--tensor-parallel-size (or, if no producer of those layouts runs any more, "
            f"delete their records in {_folder(root, layout.family_key)})")
