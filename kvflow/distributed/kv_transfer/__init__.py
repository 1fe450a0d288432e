"""KV transfer between engines (disaggregated prefill, ``--kv-transfer-config``): the
connector interface (``base``) and vLLM's example connector, SharedStorageConnector
(``shared_storage``; its worker half ``storage_worker``)."""

from __future__ import annotations

from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.distributed.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTensors,
)
from kvflow.distributed.kv_transfer.shared_storage import ExtraKeys, SharedStorageScheduler
from kvflow.distributed.kv_transfer.storage_layouts import StorageLayout
from kvflow.distributed.kv_transfer.storage_worker import SharedStorageWorker

__all__ = ["KVConnectorScheduler", "KVConnectorWorker", "KVTensors",
           "make_kv_connector_scheduler", "make_kv_connector_worker"]


def make_kv_connector_scheduler(config: KVTransferConfig, block_size: int,
                                kv_cache_dtype: str, model_key: str = "",
                                extra_keys: ExtraKeys | None = None,
                                tp_size: int = 1,
                                layout: StorageLayout | None = None) -> KVConnectorScheduler:
    """The scheduler half of ``config.kv_connector`` (SharedStorageConnector: the config
    refuses every other name); ``model_key``, ``extra_keys``, ``tp_size`` and ``layout`` as
    ``SharedStorageScheduler`` takes them.

    Raises:
        ValueError: as ``SharedStorageScheduler`` raises (a folder that cannot be created, a
            consumer of a layout no producer of its model stores)."""
    return SharedStorageScheduler(config, block_size, kv_cache_dtype, model_key,
                                  extra_keys, tp_size, layout)


def make_kv_connector_worker(config: KVTransferConfig, block_size: int, kv_cache_dtype: str,
                             kv_tensors: KVTensors, tp_rank: int = 0,
                             tp_size: int = 1) -> KVConnectorWorker:
    """The worker half of ``config.kv_connector`` over the runner's KV tensors (of
    tensor-parallel rank ``tp_rank`` of ``tp_size``)."""
    return SharedStorageWorker(config, block_size, kv_cache_dtype, kv_tensors, tp_rank,
                               tp_size)
