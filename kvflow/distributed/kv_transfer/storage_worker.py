"""SharedStorageConnector's worker half: each block of a step's loads copied from its
safetensors file into the KV tensors of every layer, each of its saves written to its file
(under a temporary name, then renamed). The storage format and the scheduler half are in
``shared_storage.py``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.distributed.kv_transfer.base import KVConnectorWorker, KVTensors
from kvflow.distributed.kv_transfer.storage_paths import block_path, make_folder
from kvflow.distributed.kv_transfer.storage_writes import write_atomically
from kvflow.kv_connector_meta import KVConnectorMetadata

logger = logging.getLogger(__name__)


class SharedStorageWorker(KVConnectorWorker):
    """The worker half: copies blocks between the KV tensors and their files.

    Args:
        config: the KV transfer config (the folder).
        block_size: tokens per KV block.
        kv_cache_dtype: the cache's dtype setting (checked against a loaded block's).
        kv_tensors: the runner's layer name -> (K/V, scales) tensors.
        tp_rank: this worker's tensor-parallel rank (it moves its own KV heads' file).
        tp_size: tensor-parallel ranks.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_dtype: str,
                 kv_tensors: KVTensors, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.root, self.block_size = config.shared_storage_path, block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.fail_on_load_error = config.kv_load_failure_policy == "fail"
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_tensors = kv_tensors
        make_folder(self.root)

    def start_load_kv(self, meta: KVConnectorMetadata) -> list[int]:
        """Copy each block of ``meta.loads`` from its file into its block of every layer.

        Returns:
            per transfer of ``meta.loads``, the index of its first block that could not be
            loaded (its file gone, unreadable, or of another shape or dtype), or -1; the
            blocks after it are not loaded (``kv_load_failure_policy="recompute"``).

        Raises:
            ValueError: with ``kv_load_failure_policy="fail"``, naming the block and file.
        """
        tensors = self.kv_tensors() if meta.loads else {}
        failed = []
        for transfer in meta.loads:
            first_bad = -1
            for i, (block_id, key) in enumerate(zip(transfer.block_ids, transfer.keys)):
                try:
                    self._load_block(tensors, transfer.req_id, block_id, key)
                except ValueError as e:
                    if self.fail_on_load_error:
                        raise
                    logger.warning("%s; its request computes it", e)
                    first_bad = i
                    break
            failed.append(first_bad)
        return failed

    def _load_block(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                    req_id: str, block_id: int, key: str) -> None:
        """Block ``block_id`` of every layer <- the file of ``key``.

        Raises:
            ValueError: naming the file, if it is gone, unreadable, or holds tensors of
                another shape or dtype (``_copy_in``).
        """
        path = block_path(self.root, key, self.tp_rank, self.tp_size)
        try:
            stored = load_file(path)
        except FileNotFoundError:
            raise ValueError(f"SharedStorageConnector: block {key} of request {req_id!r} "
                             f"left {self.root} before it was loaded") from None
        except (SafetensorError, OSError) as e:  # a truncated, corrupt or unreadable file
            raise ValueError(f"SharedStorageConnector: {path} (block of request {req_id!r}) "
                             f"cannot be read: {e}") from None
        for name, (kv, scales) in tensors.items():
            _copy_in(kv, stored, f"{name}.kv", block_id, path)
            if scales is not None:
                _copy_in(scales, stored, f"{name}.kv_scales", block_id, path)

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Write each block of ``meta.saves`` not yet in the folder (or in its ``rewrite``:
        its file failed to load) to its file (under a temporary name, then renamed).

        Raises:
            OSError: if a file cannot be written (a full disk, no permission; the step fails
                as vLLM's does); its temporary file is removed first.
        """
        tensors = self.kv_tensors() if meta.saves else {}
        for transfer in meta.saves:
            for block_id, key in zip(transfer.block_ids, transfer.keys):
                path = block_path(self.root, key, self.tp_rank, self.tp_size)
                if os.path.exists(path) and key not in transfer.rewrite:
                    continue  # another request or instance stored it meanwhile
                block: dict[str, torch.Tensor] = {}
                for name, (kv, scales) in tensors.items():
                    block[f"{name}.kv"] = kv[:, block_id].to("cpu", copy=True)
                    if scales is not None:
                        block[f"{name}.kv_scales"] = scales[:, block_id].to("cpu", copy=True)
                # a temporary name no other writer uses, then renamed: the last rename wins,
                # with equal K/V (storage_writes.py)
                write_atomically(path, self.root, functools.partial(save_file, block))


def _copy_in(cache: torch.Tensor, stored: dict[str, torch.Tensor], name: str, block_id: int,
             path: str) -> None:
    """Block ``block_id`` of ``cache`` (dim 1) <- the stored tensor ``name``.

    Raises:
        ValueError: naming the file, if the tensor is missing or its shape or dtype differ
            (another model or cache layout wrote the folder)."""
    tensor = stored.get(name)
    target = cache[:, block_id]
    if tensor is None or tensor.shape != target.shape or tensor.dtype != target.dtype:
        got = "nothing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
        raise ValueError(f"SharedStorageConnector: {path} holds {got} for {name}, this "
                         f"engine's block is {tuple(target.shape)} {target.dtype} (a "
                         "different model or KV-cache layout wrote the folder)")
    target.copy_(tensor)
