"""What a KV connector's scheduler half tells its worker half each step (pure data, carried by
``SchedulerOutput.kv_connector_metadata``; ``kvflow/distributed/kv_transfer/`` has both
halves).

A block is named by its storage key (a hex digest of the model and the prompt tokens and
extra keys up to its end, see
``distributed/kv_transfer/storage_keys.py``) and placed by its block id in the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTransfer:
    """KV blocks of one request to move between the KV cache and the connector's storage.

    Attributes:
        req_id: the request.
        block_ids: the blocks' ids in the KV cache (group 0), one per key.
        keys: the blocks' storage keys, in the same order.
        reads: for a save, the blocks of the step's loads that the request's block table
            holds: its K/V of this step were computed from theirs, so it is not saved if
            one of them could not be loaded (empty for a load, or when the step loads
            nothing the request reads).
        rewrite: for a save, those of ``keys`` whose stored file could not be loaded (corrupt,
            truncated, of another layout): written over it, where a key already stored is
            otherwise left alone.
    """

    req_id: str
    block_ids: list[int]
    keys: list[str]
    reads: list[int] = field(default_factory=list)
    rewrite: list[str] = field(default_factory=list)


@dataclass
class KVConnectorMetadata:
    """One step's KV transfers.

    Attributes:
        loads: blocks to fill from storage before the step's forward pass (their tokens
            count as computed: the forward reads them).
        saves: blocks to write to storage after the step's forward pass (every token of them
            is computed once the step has run).
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves

    def without_saves_reading(self, bad_block_ids: set[int]) -> KVConnectorMetadata:
        """The step's transfers less the saves that read one of ``bad_block_ids`` (blocks a
        load left unfilled: K/V computed over them are wrong and must not be stored)."""
        return KVConnectorMetadata(loads=self.loads, saves=[
            s for s in self.saves if bad_block_ids.isdisjoint(s.reads)])
