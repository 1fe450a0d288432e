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

A record holds the file name of one block its producers stored (its witness: written at a
producer's first save, and again at a later save once that file is gone). A record whose
witness is not in the folder, or that names none (a producer that has stored nothing yet, a
record written before witnesses were), is stale: no stored block is known to be of its layout
(the blocks were deleted, e.g. by ``rm {shared_storage_path}/*``, which leaves the dot
folders). A consumer is refused or warned only for live records of other layouts, and says
which stale ones it ignored (``read_records``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

from kvflow.distributed.kv_transfer.storage_writes import write_atomically

__all__ = ["ForeignLayouts", "StorageLayout", "foreign_layouts", "layout_name",
           "mismatch_message", "read_records", "record_layout", "record_witness",
           "stale_message"]

logger = logging.getLogger(__name__)

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


def record_witness(root: str, layout: StorageLayout, block_file: str) -> bool:
    """Write ``block_file`` (the name of a block file in ``root`` a producer of ``layout``
    stores) into ``layout``'s record, whole (``storage_writes.py``): while that file is
    there, the record is live (see the module).

    Returns:
        Whether it was written; False, with a warning, if not (an OS error: the record stays
        as it was, the blocks are stored all the same).
    """
    path = os.path.join(_folder(root, layout.family_key), layout.name)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(block_file)

    try:
        return write_atomically(path, root, write)
    except OSError as e:
        logger.warning("SharedStorageConnector: cannot write the layout record %s: %s", path,
                       e.strerror or e)
        return False


class ForeignLayouts(NamedTuple):
    """The other layouts the producers of a model recorded in a folder, sorted: ``live``
    (their record's witness block is stored) and ``stale`` (it is not, or none is named)."""

    live: list[str]
    stale: list[str]


def read_records(root: str, layout: StorageLayout) -> ForeignLayouts:
    """The layouts the producers of ``layout``'s model recorded in ``root``, when none of
    them is ``layout`` (so none of their blocks is ever found by an engine of ``layout``),
    as live and stale (see the module); else (``layout`` among them, or none recorded) two
    empty lists."""
    folder = _folder(root, layout.family_key)
    try:
        recorded = sorted(os.listdir(folder))
    except OSError:  # no producer of this model recorded one (or the folder is unreadable)
        return ForeignLayouts([], [])
    if layout.name in recorded:
        return ForeignLayouts([], [])
    live = [name for name in recorded if _witness_stored(root, os.path.join(folder, name))]
    return ForeignLayouts(live, [name for name in recorded if name not in live])


def _witness_stored(root: str, record: str) -> bool:
    """Whether the record file ``record`` names a block file that is in ``root``."""
    try:
        with open(record) as f:
            name = os.path.basename(f.read(4096).strip())
    except (OSError, UnicodeDecodeError):
        return False
    return name.endswith(".safetensors") and os.path.isfile(os.path.join(root, name))


def foreign_layouts(root: str, layout: StorageLayout) -> list[str]:
    """The live layouts of ``read_records``: those of which a block is stored."""
    return read_records(root, layout).live


def mismatch_message(root: str, layout: StorageLayout, recorded: list[str]) -> str:
    """What a consumer of ``layout`` says when the producers of its model in ``root`` store
    only ``recorded`` layouts."""
    return (f"kv_transfer_config: the producers of this model in shared_storage_path="
            f"{root!r} store KV blocks of {' / '.join(recorded)}; this engine's KV cache is "
            f"{layout.name}, so it can load none of them (every prompt is computed): start it "
            "with the producers' --dtype, --block-size, --kv-cache-dtype and "
            "--tensor-parallel-size (or, if no producer of those layouts runs any more, "
            f"delete their records in {_folder(root, layout.family_key)})")


def stale_message(root: str, layout: StorageLayout, stale: list[str]) -> str:
    """What a consumer of ``layout`` says of the ``stale`` records it ignores in ``root``."""
    return (f"kv_transfer_config: ignoring the stale layout records {' / '.join(stale)} in "
            f"{_folder(root, layout.family_key)}: none names a KV block still stored in "
            f"shared_storage_path={root!r} (their blocks were deleted, or their producer has "
            "stored none yet)")
