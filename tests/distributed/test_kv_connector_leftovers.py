"""SharedStorageConnector's leftovers: temporary files of saves a kill interrupted
(``storage_writes.py``).

Oracle: the folder's files, listed by hand (``os.walk``, dot folders included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from kvflow.config import KVTransferConfig
from kvflow.distributed.kv_transfer.shared_storage import (
    SharedStorageScheduler,
    SharedStorageWorker,
    block_keys,
    is_stored,
)
from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata
from tests.distributed.test_kv_connector import (
    BLOCK_SIZE,
    _kv,
)

KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import kvflow.distributed.kv_transfer.shared_storage as ss
    from kvflow.config import KVTransferConfig
    from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata

    root, key = sys.argv[1], sys.argv[2]
    kv = torch.zeros(2, 2, 4, 2, 8)
    config = KVTransferConfig.from_value({"kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": root}})
    worker = ss.SharedStorageWorker(config, 4, "auto", lambda: {"layer.0": (kv, None)})

    def killed(tensors, filename):  # half the file written, then the process is gone
        with open(filename, "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)

    ss.save_file = killed
    worker.wait_for_save(KVConnectorMetadata(saves=[BlockTransfer("r", [1], [key])]))
""")


def _files(root) -> list[str]:
    """Every file under ``root``, dot folders included, relative to it."""
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, names in os.walk(root) for name in names)


def _config(root, role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig.from_value(_kv(str(root), role))


def test_a_save_killed_mid_write_is_never_read_and_the_next_producer_removes_it(tmp_path):
    """A producer SIGKILLed while it writes a block leaves its temporary file (nothing runs
    after a SIGKILL): the block does not count as stored, a producer starting at once leaves
    the file (a live writer of another engine could own it), and one starting once the file
    is over an hour old removes it (was: left forever, one per interrupted save)."""
    key = block_keys(list(range(BLOCK_SIZE)), BLOCK_SIZE, "auto")[0]
    done = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path), key],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (left,) = _files(tmp_path)
    assert left.endswith(".tmp") and (tmp_path / left).read_bytes() == b"partial"
    assert not is_stored(str(tmp_path), key)  # a reader never takes it

    SharedStorageScheduler(_config(tmp_path), BLOCK_SIZE, "auto")  # a producer starts
    assert left in _files(tmp_path)  # young: maybe another engine's save in progress
    SharedStorageScheduler(_config(tmp_path, "kv_consumer"), BLOCK_SIZE, "auto")
    hour_ago = time.time() - 3600
    os.utime(tmp_path / left, (hour_ago, hour_ago))
    SharedStorageScheduler(_config(tmp_path, "kv_consumer"), BLOCK_SIZE, "auto")
    assert left in _files(tmp_path)  # a consumer only reads the folder
    SharedStorageScheduler(_config(tmp_path, "kv_producer"), BLOCK_SIZE, "auto")
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]


def test_a_writer_whose_temporary_file_was_removed_stores_nothing_and_goes_on(
        tmp_path, monkeypatch, caplog):
    """A writer stalled past the orphan age, whose temporary file another engine's start
    removed meanwhile: its save stores nothing and warns, the step goes on (was: the rename's
    FileNotFoundError failed the step), and the next save of the block stores it."""
    import kvflow.distributed.kv_transfer.shared_storage as ss

    kv = torch.arange(2 * 2 * BLOCK_SIZE * 2 * 8, dtype=torch.float32).reshape(
        2, 2, BLOCK_SIZE, 2, 8)
    worker = SharedStorageWorker(_config(tmp_path), BLOCK_SIZE, "auto",
                                 lambda: {"layer.0": (kv, None)})
    key = block_keys(list(range(BLOCK_SIZE)), BLOCK_SIZE, "auto")[0]
    meta = KVConnectorMetadata(saves=[BlockTransfer("r", [1], [key])])
    real_save = ss.save_file

    def swept(tensors, filename):
        real_save(tensors, filename)
        os.remove(filename)  # what another engine's start does to a file over the age

    monkeypatch.setattr(ss, "save_file", swept)
    with caplog.at_level("WARNING", "kvflow.distributed.kv_transfer.storage_writes"):
        worker.wait_for_save(meta)
    assert not is_stored(str(tmp_path), key) and _files(tmp_path) == []
    assert any("removed before its rename" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(ss, "save_file", real_save)
    worker.wait_for_save(meta)
    assert _files(tmp_path) == [f"{key}.safetensors"]
