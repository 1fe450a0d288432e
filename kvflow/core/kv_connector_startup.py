"""The KV connector's scheduler half built at start-up (``--kv-transfer-config``), and the
identity its keys and layout record take from the model's files (again after
``reload_weights``). The runner builds its worker half from the same config."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.core.block_hashing import connector_extra_keys
from kvflow.distributed.kv_transfer import KVConnectorScheduler, make_kv_connector_scheduler
from kvflow.distributed.kv_transfer.storage_keys import model_identity
from kvflow.distributed.kv_transfer.storage_layouts import StorageLayout, layout_name
from kvflow.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from kvflow.layers.rotary import long_prompt_rope


def check_connector_groups(kv_cache_config: KVCacheConfig) -> None:
    """The connector stores one full-attention KV-cache group's blocks only.

    Raises:
        ValueError: for KV-cache groups other than one full-attention group (sliding
            window layers, MLA's latent cache): their blocks are not stored yet.
    """
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    if len(groups) > 1 or type(spec) is not FullAttentionSpec:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(f"kv_transfer_config needs a model whose attention layers all "
                         f"attend in full (one KV-cache group of FullAttentionSpec); this "
                         f"one has {len(groups)} group(s) of {kinds} (sliding-window or "
                         "MLA layers), which the connector does not store yet")


def connector_identity(config: EngineConfig, model_path: str, hf_config: Any,
                       dtype: torch.dtype) -> tuple[str, StorageLayout]:
    """The KV connector's ``model_identity`` of the model as its files (in ``model_path``)
    are now, and its layout record (the identity without the dtype; ``storage_layouts.py``).
    """
    mc, cc = config.model_config, config.cache_config
    tp = config.parallel_config.tensor_parallel_size
    layout = StorageLayout(  # the producers' layouts of this model, whatever its dtype
        model_identity(model_path, hf_config, None, mc),
        layout_name(cc.block_size, cc.kv_cache_dtype, tp, str(dtype).split(".")[-1]))
    return model_identity(model_path, hf_config, dtype, mc), layout


def make_connector(config: EngineConfig, kv_cache_config: KVCacheConfig, model_path: str,
                   hf_config: Any, dtype: torch.dtype) -> KVConnectorScheduler:
    """The scheduler half of ``config.kv_transfer_config`` (not None) for this model: keys
    seeded by :func:`connector_identity`, the prefix cache's extra keys per block.

    Raises:
        ValueError: as :func:`check_connector_groups`; for a ``kv_consumer`` of a layout no
            producer of its model in the folder stores (``storage_layouts.py``), or a folder
            that cannot be created (``make_kv_connector_scheduler``).
    """
    check_connector_groups(kv_cache_config)
    cc = config.cache_config
    rope = long_prompt_rope(hf_config)
    model_key, layout = connector_identity(config, model_path, hf_config, dtype)
    return make_kv_connector_scheduler(
        config.kv_transfer_config, cc.block_size, cc.kv_cache_dtype, model_key,
        connector_extra_keys(rope.original if rope is not None else None),
        config.parallel_config.tensor_parallel_size, layout)
