"""The blocks the KV cache manager hands the scheduler for one request (``KVCacheBlocks``):
a plain value that crosses from ``core/kv_cache_manager.py`` to the scheduler's modules."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.core.block_pool import KVCacheBlock


@dataclass(frozen=True)
class KVCacheBlocks:
    """Runs of blocks handed to the scheduler, one per KV-cache group (valid until the request
    is freed). All groups' runs are equally long; entries a sliding window no longer needs are
    the null block.
    """

    blocks: tuple[tuple[KVCacheBlock, ...], ...] = ()

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([b.block_id for b in run] for run in self.blocks)

    def group(self, group_id: int) -> tuple[KVCacheBlock, ...]:
        return self.blocks[group_id] if self.blocks else ()

    def __len__(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


EMPTY_BLOCKS = KVCacheBlocks()
