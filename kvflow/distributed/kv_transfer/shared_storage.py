"""SharedStorageConnector (vLLM's example connector, kvflow's own layout): a producer writes
each full prompt block's K/V to a folder shared by the instances; a consumer with the same
model finds the blocks of a new prompt there and loads them instead of computing them.

Storage: one safetensors file per KV block, ``{shared_storage_path}/{key}.safetensors``, with
two tensors per attention layer: ``{layer}.kv`` [2, block_size, kv_heads, head_dim] (0 = K,
1 = V, the cache's dtype) and, for a quantized cache (``--kv-cache-dtype int8|fp8_e4m3``),
``{layer}.kv_scales`` [2, block_size, kv_heads] float32. The key of block ``i`` is a SHA-256
chain over the prompt's tokens up to the block's end:
``key_i = sha256(key_{i-1} || int64 tokens of block i)``, starting from a digest of the block
size, the KV-cache dtype and the request's ``cache_salt``; so a block is shared by every
prompt with the same tokens up to its end (a prefix), and caches of another block size or
dtype never meet. Files are written to a temporary name and renamed, so a reader never sees
half a block.

Which requests take part: only text prompts of the base model (no LoRA adapter, image or
prompt embeddings, whose K/V the tokens alone do not determine), and none asking for prompt
logprobs (they need every prompt token computed) or pooling.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.distributed.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTensors,
)
from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata
from kvflow.request import Request


def block_keys(tokens: Sequence[int], block_size: int, kv_cache_dtype: str,
               cache_salt: str | None = None) -> list[str]:
    """The storage keys (64 hex digits) of the full blocks of ``tokens`` (see the module)."""
    seed = f"kvflow-shared-storage-v1|{block_size}|{kv_cache_dtype}|{cache_salt or ''}"
    parent = hashlib.sha256(seed.encode()).digest()
    ids = np.asarray(tokens[:len(tokens) // block_size * block_size], dtype="<i8")
    keys = []
    for i in range(len(ids) // block_size):
        parent = hashlib.sha256(parent + ids[i * block_size:(i + 1) * block_size].tobytes()
                                ).digest()
        keys.append(parent.hex())
    return keys


def block_path(root: str, key: str) -> str:
    """The file of the block stored under ``key``."""
    return os.path.join(root, f"{key}.safetensors")


def takes_part(request: Request) -> bool:
    """Whether the connector loads or saves ``request``'s blocks (see the module)."""
    return request.lora_request is None and request.mm_features is None and \
        request.prompt_embeds is None and request.pooling_params is None and \
        not request.skips_prefix_cache


@dataclass
class _RequestState:
    keys: list[str]  # of the prompt's full blocks
    num_saved: int = 0  # leading prompt blocks saved (or found stored)
    loads: list[BlockTransfer] = field(default_factory=list)


class SharedStorageScheduler(KVConnectorScheduler):
    """The scheduler half: finds stored blocks, plans loads and saves.

    Args:
        config: the KV transfer config (role and folder).
        block_size: tokens per KV block.
        kv_cache_dtype: the cache's dtype setting (part of every key).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_dtype: str) -> None:
        self.config, self.block_size, self.kv_cache_dtype = config, block_size, kv_cache_dtype
        self.root = config.shared_storage_path
        os.makedirs(self.root, exist_ok=True)
        self._states: dict[str, _RequestState] = {}
        self._loads: list[BlockTransfer] = []
        self.num_loaded_blocks = 0  # statistics: blocks loaded / saved since start
        self.num_saved_blocks = 0

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            keys = block_keys(request.prompt_token_ids, self.block_size, self.kv_cache_dtype,
                              request.cache_salt)
            state = self._states[request.request_id] = _RequestState(keys)
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.is_consumer or not takes_part(request):
            return 0
        keys = self._state(request).keys
        # never the last token: its logits are needed (a prompt of whole blocks loads one less)
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        found = first
        while found < max_blocks and os.path.exists(block_path(self.root, keys[found])):
            found += 1
        return (found - first) * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_computed_tokens: int, num_external_tokens: int) -> None:
        state = self._state(request)
        first = num_computed_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        self._loads.append(BlockTransfer(request.request_id, list(block_ids[first:end]),
                                         state.keys[first:end]))
        self.num_loaded_blocks += end - first

    def build_connector_meta(self, scheduled: Sequence[Request],
                             block_ids_of: Callable[[str], Sequence[int]]
                             ) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.config.is_producer:
            planned: set[str] = set()  # keys this step saves (two prompts may share a block)
            for request in scheduled:
                save = self._new_saves(request, block_ids_of, planned)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _new_saves(self, request: Request, block_ids_of: Callable[[str], Sequence[int]],
                   planned: set[str]) -> BlockTransfer | None:
        """The prompt blocks of ``request`` complete after this step, neither stored nor in
        ``planned`` yet (they are added to it)."""
        if not takes_part(request):
            return None
        state = self._state(request)
        done = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        if done <= state.num_saved:
            return None
        table = block_ids_of(request.request_id)
        todo = []
        for i in range(state.num_saved, done):
            key = state.keys[i]
            if key not in planned and not os.path.exists(block_path(self.root, key)):
                planned.add(key)
                todo.append(i)
        state.num_saved = done
        if not todo:
            return None
        self.num_saved_blocks += len(todo)
        return BlockTransfer(request.request_id, [table[i] for i in todo],
                             [state.keys[i] for i in todo])

    def request_finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)


class SharedStorageWorker(KVConnectorWorker):
    """The worker half: copies blocks between the KV tensors and their files.

    Args:
        config: the KV transfer config (the folder).
        block_size: tokens per KV block.
        kv_cache_dtype: the cache's dtype setting (checked against a loaded block's).
        kv_tensors: the runner's layer name -> (K/V, scales) tensors.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_dtype: str,
                 kv_tensors: KVTensors) -> None:
        self.root, self.block_size = config.shared_storage_path, block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_tensors = kv_tensors
        os.makedirs(self.root, exist_ok=True)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Copy each block of ``meta.loads`` from its file into its block of every layer.

        Raises:
            ValueError: if a file is gone, or holds tensors of another shape or dtype
                (``_copy_in``).
        """
        tensors = self.kv_tensors() if meta.loads else {}
        for transfer in meta.loads:
            for block_id, key in zip(transfer.block_ids, transfer.keys):
                path = block_path(self.root, key)
                try:
                    stored = load_file(path)
                except FileNotFoundError:
                    raise ValueError(f"SharedStorageConnector: block {key} of request "
                                     f"{transfer.req_id!r} left {self.root} before it was "
                                     "loaded") from None
                for name, (kv, scales) in tensors.items():
                    _copy_in(kv, stored, f"{name}.kv", block_id, path)
                    if scales is not None:
                        _copy_in(scales, stored, f"{name}.kv_scales", block_id, path)

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        tensors = self.kv_tensors() if meta.saves else {}
        for transfer in meta.saves:
            for block_id, key in zip(transfer.block_ids, transfer.keys):
                path = block_path(self.root, key)
                if os.path.exists(path):  # another request or instance stored it meanwhile
                    continue
                block: dict[str, torch.Tensor] = {}
                for name, (kv, scales) in tensors.items():
                    block[f"{name}.kv"] = kv[:, block_id].to("cpu", copy=True)
                    if scales is not None:
                        block[f"{name}.kv_scales"] = scales[:, block_id].to("cpu", copy=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                save_file(block, tmp)
                os.replace(tmp, path)


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
