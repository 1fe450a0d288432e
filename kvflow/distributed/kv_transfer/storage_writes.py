"""SharedStorageConnector's writes: every file (a KV block, a layout record's witness) is
written whole under a temporary name in ``{shared_storage_path}/.kvflow-tmp/`` and then renamed
onto its own name (``os.replace``, atomic on one file system), so a reader finds either no file
or a whole one, never a temporary or partial one (block names never end in ``.tmp``, and the
temporary files are in a folder of their own).

A temporary name is ``{name}.{pid}.{32 random hex digits}.tmp``: no two writers share one
(processes in two containers may share a pid, two engines may share a process). A write that
raises (a full disk) removes its temporary file. One that never returns (its process killed,
its machine down) leaves it: a producer starting on the folder removes each temporary file
older than ``ORPHAN_AGE_S`` (``remove_orphans``). A write of one file takes milliseconds, so
a file that old has no live writer; a writer stalled past it (a stopped process) finds its
file gone at the rename and stores nothing (a later save of the block writes it again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["ORPHAN_AGE_S", "TMP_FOLDER", "remove_orphans", "write_atomically"]

logger = logging.getLogger(__name__)

TMP_FOLDER = ".kvflow-tmp"
ORPHAN_AGE_S = 600.0  # seconds since a temporary file's last write: left by a dead writer


def tmp_folder(root: str) -> str:
    """The folder of the temporary files of storage folder ``root``."""
    return os.path.join(root, TMP_FOLDER)


def write_atomically(path: str, root: str, write: Callable[[str], Any]) -> bool:
    """Write the file ``path`` of storage folder ``root`` whole: ``write(tmp)`` writes it
    under a temporary name of its own (see the module), which is then renamed to ``path``.

    Returns:
        Whether ``path`` was written; False (with a warning) if the temporary file was gone
        at the rename (removed as an orphan while this writer was stalled past
        ``ORPHAN_AGE_S``).

    Raises:
        OSError: what ``write`` or the rename raise otherwise (a full disk, no permission);
            the temporary file is removed first. Anything else ``write`` raises, likewise.
    """
    folder = tmp_folder(root)
    os.makedirs(folder, exist_ok=True)  # one stat when there (a user may have removed it)
    tmp = os.path.join(folder, f"{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
    except BaseException:  # a full disk, an interrupt: no partial file left behind
        _remove(tmp)
        raise
    try:
        os.replace(tmp, path)
    except FileNotFoundError:
        if os.path.isdir(os.path.dirname(path)) and not os.path.exists(tmp):
            logger.warning("SharedStorageConnector: the temporary file of %s was removed "
                           "before its rename (its writer stalled over %.0f s); not stored",
                           path, ORPHAN_AGE_S)
            return False
        _remove(tmp)
        raise
    except BaseException:
        _remove(tmp)
        raise
    return True


def remove_orphans(root: str, max_age_s: float = ORPHAN_AGE_S) -> int:
    """Remove the temporary files of storage folder ``root`` whose last write is more than
    ``max_age_s`` seconds old (left by writers that died mid-write: see the module). Files
    that vanish meanwhile (another engine removing them too) or cannot be removed (a
    read-only folder) are skipped.

    Returns:
        How many files this call removed.
    """
    try:
        entries = list(os.scandir(tmp_folder(root)))
    except OSError:  # no temporary file was ever written (or the folder is unreadable)
        return 0
    oldest = time.time() - max_age_s
    removed = 0
    for entry in entries:
        try:
            if entry.name.endswith(".tmp") and entry.stat().st_mtime < oldest:
                os.remove(entry.path)
                removed += 1
        except OSError:
            continue
    if removed:
        logger.info("SharedStorageConnector: removed %d temporary files older than %.0f s in "
                    "%s (saves interrupted by a kill or crash)", removed, max_age_s,
                    tmp_folder(root))
    return removed


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
