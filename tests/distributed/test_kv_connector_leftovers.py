"""SharedStorageConnector's leftovers: temporary files of saves a kill interrupted, and layout
records whose blocks are gone (``storage_writes.py``, ``storage_layouts.py``).

Oracles: the folder's files, listed by hand (``os.walk``, dot folders included); HF
transformers' greedy tokens for a consumer that starts despite a stale record.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvflow.config import KVTransferConfig
from kvflow.distributed.kv_transfer.shared_storage import SharedStorageScheduler
from kvflow.distributed.kv_transfer.storage_keys import block_keys
from kvflow.distributed.kv_transfer.storage_worker import SharedStorageWorker
from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata
from tests.distributed.test_kv_connector import (
    BLOCK_SIZE,
    GREEDY,
    _hf_greedy,
    _kv,
    _llm,
    _produce,
    _prompts,
)

KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import kvflow.distributed.kv_transfer.storage_worker as ss
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
    assert not (tmp_path / f"{key}.safetensors").exists()  # a reader never takes it

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
    import kvflow.distributed.kv_transfer.storage_worker as ss

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
    assert not (tmp_path / f"{key}.safetensors").exists() and _files(tmp_path) == []
    assert any("removed before its rename" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(ss, "save_file", real_save)
    worker.wait_for_save(meta)
    assert _files(tmp_path) == [f"{key}.safetensors"]


@pytest.mark.parametrize("cleared", ["blocks", "none"])
def test_a_record_whose_blocks_were_deleted_is_ignored_saying_so(tiny_llama, tmp_path, caplog,
                                                                 cleared):
    """A producer of another block size stored a prompt's blocks; the blocks are then
    deleted (``rm folder/*``, which leaves the dot folders and so the layout records). A
    consumer of this layout starts (was: refused, naming a layout of which nothing is
    stored), says which record it ignores and why, and computes the prompt (HF's tokens).
    With the blocks still there it is refused as before."""
    prompt = _prompts(tiny_llama.vocab_size)[0]
    _produce(tiny_llama.path, str(tmp_path), [prompt], block_size=8)
    stored = glob.glob(f"{tmp_path}/*.safetensors")
    (record,) = glob.glob(f"{tmp_path}/.kvflow-layouts/*/*")
    assert "block_size=8," in record
    if cleared == "none":
        with open(record) as f:  # its witness: one of the blocks the producer stored
            assert os.path.join(str(tmp_path), f.read()) in stored
        with pytest.raises(ValueError, match="store KV blocks of .*block_size=8,"):
            _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
        return
    for path in stored:
        os.remove(path)
    with caplog.at_level("INFO", "kvflow.distributed.kv_transfer.shared_storage"):
        consumer = _llm(tiny_llama.path, str(tmp_path), "kv_consumer")
    try:
        out = consumer.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    finally:
        consumer.shutdown()
    assert out.metrics.num_cached_tokens == 0
    assert out.outputs[0].token_ids == _hf_greedy(tiny_llama, prompt)
    said = [r.getMessage() for r in caplog.records if "stale layout records" in r.message]
    assert len(said) == 1 and "block_size=8," in said[0] and "none names a KV block" in said[0]



def test_a_producer_names_a_new_block_once_its_records_block_is_gone(tiny_llama, tmp_path):
    """The record's witness is rewritten at the first save after its block is deleted, so a
    producer that keeps running keeps its record live; a record naming a file outside the
    folder, or no block file, is stale."""
    from kvflow.distributed.kv_transfer.storage_layouts import StorageLayout, read_records

    first, second = _prompts(tiny_llama.vocab_size)[:2]
    producer = _llm(tiny_llama.path, str(tmp_path), "kv_producer")
    try:
        producer.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
        (record,) = glob.glob(f"{tmp_path}/.kvflow-layouts/*/*")
        for path in glob.glob(f"{tmp_path}/*.safetensors"):
            os.remove(path)
        producer.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)
    finally:
        producer.shutdown()
    with open(record) as f:
        witness = f.read()
    assert os.path.isfile(tmp_path / witness)  # one of the second prompt's blocks
    family, name = record.split(os.sep)[-2:]
    other = StorageLayout(family, "another layout")
    assert read_records(str(tmp_path), other) == ([name], [])
    outside = tmp_path / "elsewhere" / "x.safetensors"  # a file, but not in the folder
    os.makedirs(outside.parent)
    outside.write_bytes(b"")
    for content in ("", witness.removesuffix(".safetensors"), str(outside)):
        with open(record, "w") as f:
            f.write(content)
        assert read_records(str(tmp_path), other) == ([], [name]), content
