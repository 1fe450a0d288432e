"""What a KV connector's scheduler half tells its worker half each step (pure data, carried by
``SchedulerOutput.kv_connector_metadata``; ``kvflow/distributed/kv_transfer/`` has both
halves).

A block is named by its storage key (a hex digest of the model and the prompt tokens and
extra keys up to its end, see
``distributed/kv_transfer/shared_storage.py``) and placed by its block id in the KV cache.
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
    """

    req_id: str
    block_ids: list[int]
    keys: list[str]


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
