"""SharedStorageConnector (vLLM's example connector, kvflow's own layout): a producer writes
each full prompt block's K/V to a folder shared by the instances; a consumer with the same
model finds the blocks of a new prompt there and loads them instead of computing them.

Storage: one safetensors file per KV block, ``{shared_storage_path}/{key}.safetensors`` (under
tensor parallelism one per rank, ``{key}.tp{size}_rank{rank}.safetensors``, holding the rank's
KV heads; a block counts as stored once every rank's file is there; ``storage_paths.py``),
with two tensors per attention layer: ``{layer}.kv`` [2, block_size, kv_heads, head_dim]
(0 = K, 1 = V, the cache's dtype) and, for a quantized cache (``--kv-cache-dtype int8|fp8_e4m3``),
``{layer}.kv_scales`` [2, block_size, kv_heads] float32. Files are written to a temporary name
of their own in ``.kvflow-tmp/`` and renamed, so a reader never sees half a block; a producer
starting on the folder removes the temporary files of saves a kill or crash interrupted
(``storage_writes.py``).
A file that could not be loaded (truncated, garbage, another layout) is written over the same
way by the first producer that recomputes its block after the failure, so the next instance
loads it again (a consumer only reads, and leaves it).

Keys: a SHA-256 chain over each block's tokens and everything its K/V depends on
(``storage_keys.py``: ``block_keys`` from ``model_identity``). Layouts: each producer
records its compute dtype, block size, KV-cache dtype and tensor-parallel size in the folder;
a ``kv_consumer`` whose layout no producer of its model records is refused at start-up, or
warned at its first miss once such a producer has started, when blocks of those other layouts
are stored (records that name no stored block are stale: ignored, saying so;
``storage_layouts.py``).

The worker half, copying blocks between the KV tensors and their files, is
``storage_worker.py``.

Which requests take part: every generation request (prompt embeddings too: their digest is an
extra key of every block) stores its blocks; those asking for prompt logprobs load none (they
need every prompt token computed); no pooling request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.distributed.kv_transfer.base import KVConnectorScheduler
from kvflow.distributed.kv_transfer.storage_keys import block_keys
from kvflow.distributed.kv_transfer.storage_layouts import (
    StorageLayout,
    foreign_layouts,
    layout_name,
    mismatch_message,
    read_records,
    record_layout,
    record_witness,
    stale_message,
)
from kvflow.distributed.kv_transfer.storage_paths import block_path, is_stored, make_folder
from kvflow.distributed.kv_transfer.storage_writes import remove_orphans
from kvflow.kv_connector_meta import BlockTransfer, KVConnectorMetadata
from kvflow.request import Request

logger = logging.getLogger(__name__)
# request -> (start, end) -> the extra key of the request's block [start, end)
ExtraKeys = Callable[[Request], Callable[[int, int], Any]]


def takes_part(request: Request) -> bool:
    """Whether the connector loads ``request``'s blocks (see the module)."""
    return request.pooling_params is None and not request.skips_prefix_cache


def saves_blocks(request: Request) -> bool:
    """Whether the connector saves ``request``'s blocks: every generation request, those
    asking for prompt logprobs too (whose K/V are computed like any other's: only their
    loads are skipped, while their prompt logprobs are not all computed)."""
    return request.pooling_params is None


@dataclass
class _RequestState:
    keys: list[str]  # of the prompt's full blocks
    num_saved: int = 0  # leading prompt blocks saved (or found stored)
    loads: list[BlockTransfer] = field(default_factory=list)
    rewrites: list[str] = field(default_factory=list)  # bad files its saves replace
    layout_checked: bool = False  # its miss was checked against the producers' layouts


class SharedStorageScheduler(KVConnectorScheduler):
    """The scheduler half: finds stored blocks, plans loads and saves.

    Args:
        config: the KV transfer config (role and folder).
        block_size: tokens per KV block.
        kv_cache_dtype: the cache's dtype setting (part of every key).
        model_key: ``model_identity`` of the engine (part of every key).
        extra_keys: a request -> its blocks' extra keys (``core/block_hashing.py``
            ``connector_extra_keys``: adapter, images, salt, ...), or None (tokens only).
        tp_size: tensor-parallel ranks (a block is stored once each has written its file).
        layout: its layout record (``storage_layouts.py``: the model's dtype-free identity
            and the compute dtype, block size, KV-cache dtype and TP size), or None for one
            of ``model_key`` and the three settings.

    Raises:
        ValueError: naming ``shared_storage_path``, if the folder cannot be created or (a
            producer) its layout cannot be recorded there; for a ``kv_consumer``, naming
            both layouts, if the folder's producers of this model store only blocks of
            another compute dtype, block size, KV-cache dtype or tensor-parallel size
            (``storage_layouts.py``: it could load none of them; stale records, naming no
            stored block, are ignored).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_dtype: str,
                 model_key: str = "", extra_keys: ExtraKeys | None = None,
                 tp_size: int = 1, layout: StorageLayout | None = None) -> None:
        self.config, self.block_size, self.kv_cache_dtype = config, block_size, kv_cache_dtype
        self.model_key, self.extra_keys = model_key, extra_keys
        self.tp_size = tp_size
        self.root = config.shared_storage_path
        make_folder(self.root)
        if config.is_producer:
            remove_orphans(self.root)  # temporary files of saves a kill interrupted
        self._states: dict[str, _RequestState] = {}
        self._loads: list[BlockTransfer] = []
        self._bad_keys: set[str] = set()  # blocks a worker failed to load: never offered again
        self._to_rewrite: set[str] = set()  # of those, the files no save has replaced yet
        self._stale: set[str] = set()  # requests running at a reload of the weights
        self.num_loaded_blocks = 0  # statistics: blocks loaded / saved since start
        self.num_saved_blocks = 0
        self._init_layout(layout)

    def _init_layout(self, layout: StorageLayout | None) -> None:
        """A producer records its layout; a consumer refuses a folder whose producers of
        this model store only other layouts (see ``storage_layouts.py``)."""
        self.layout = layout if layout is not None else StorageLayout(
            self.model_key, layout_name(self.block_size, self.kv_cache_dtype, self.tp_size))
        self._warned_layouts: list[str] = []  # the foreign layouts last warned about
        self._witness: str | None = None  # the block file its layout record names
        if self.config.is_producer:
            record_layout(self.root, self.layout)
            return
        records = read_records(self.root, self.layout)
        if records.stale:
            logger.info("%s", stale_message(self.root, self.layout, records.stale))
        if records.live:
            raise ValueError(mismatch_message(self.root, self.layout, records.live))

    def _check_layout(self, state: _RequestState) -> None:
        """A consumer's request found none of its blocks: warn (once per set of layouts)
        when producers of another layout started since (``storage_layouts.py``)."""
        state.layout_checked = True
        recorded = foreign_layouts(self.root, self.layout)
        if recorded and recorded != self._warned_layouts:
            self._warned_layouts = recorded
            logger.warning("%s", mismatch_message(self.root, self.layout, recorded))

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            keys = block_keys(request.prompt_token_ids, self.block_size, self.kv_cache_dtype,
                              self.model_key, None if self.extra_keys is None
                              else self.extra_keys(request))
            state = self._states[request.request_id] = _RequestState(keys)
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.is_consumer or not takes_part(request):
            return 0
        state = self._state(request)
        keys = state.keys
        # never the last token: its logits are needed (a prompt of whole blocks loads one less)
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        found = first
        while found < max_blocks and keys[found] not in self._bad_keys and \
                is_stored(self.root, keys[found], self.tp_size):
            found += 1
        if found == 0 < max_blocks and not state.layout_checked and \
                not self.config.is_producer:
            self._check_layout(state)
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
            loaded = {b for transfer in meta.loads for b in transfer.block_ids}
            for request in scheduled:
                save = self._new_saves(request, block_ids_of, planned)
                if save is not None:
                    if loaded:  # the step's loads its K/V read (not saved if one fails)
                        save.reads = [b for b in block_ids_of(request.request_id)
                                      if b in loaded]
                    meta.saves.append(save)
            self._refresh_witness(meta.saves)
        return meta

    def _refresh_witness(self, saves: Sequence[BlockTransfer]) -> None:
        """Name the last block of ``saves`` in this producer's layout record, if the block
        file it names is gone or none is named yet (``storage_layouts.py``: the record stays
        live while that file is there; one stat per step that saves)."""
        if not saves or (self._witness is not None
                         and os.path.exists(os.path.join(self.root, self._witness))):
            return
        name = os.path.basename(block_path(self.root, saves[-1].keys[-1], 0, self.tp_size))
        if record_witness(self.root, self.layout, name):
            self._witness = name

    def _new_saves(self, request: Request, block_ids_of: Callable[[str], Sequence[int]],
                   planned: set[str]) -> BlockTransfer | None:
        """The prompt blocks of ``request`` complete after this step, neither stored nor in
        ``planned`` yet (they are added to it)."""
        if not saves_blocks(request) or request.request_id in self._stale:
            return None
        state = self._state(request)
        done = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        if done <= state.num_saved:
            return None
        table = block_ids_of(request.request_id)
        todo, rewrite = [], []
        for i in range(state.num_saved, done):
            key = state.keys[i]
            if key in planned:
                continue
            if key in self._to_rewrite:  # its file failed to load: replace it
                self._to_rewrite.discard(key)
                state.rewrites.append(key)
                rewrite.append(key)
            elif is_stored(self.root, key, self.tp_size):
                continue
            planned.add(key)
            todo.append(i)
        state.num_saved = done
        if not todo:
            return None
        self.num_saved_blocks += len(todo)
        return BlockTransfer(request.request_id, [table[i] for i in todo],
                             [state.keys[i] for i in todo], rewrite=rewrite)

    def load_failed(self, request: Request, key: str) -> int:
        self._bad_keys.add(key)
        if self.config.is_producer:
            self._to_rewrite.add(key)
        self.saves_dropped(request)
        return self._state(request).keys.index(key)

    def saves_dropped(self, request: Request) -> None:
        # a producer stores what the recompute writes (files left out, skipped saves too)
        state = self._state(request)
        state.num_saved = 0
        self._to_rewrite.update(state.rewrites)  # a dropped save replaced no file
        state.rewrites.clear()

    def weights_changed(self, model_key: str, layout: StorageLayout,
                        running: set[str]) -> None:
        # every request's keys are taken again (of the new identity) at its next use
        self.model_key = model_key
        self._states.clear()
        self._stale |= running
        self.layout = layout
        self._warned_layouts = []
        self._witness = None
        if self.config.is_producer:
            record_layout(self.root, layout)

    def request_finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        self._stale.discard(request.request_id)
