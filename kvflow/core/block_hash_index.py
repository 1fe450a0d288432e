"""The prefix cache's index: block hash -> every block indexed under it (vLLM's
``BlockHashToBlockMap``).

Requests that compute the same full block apart (a block-aligned prompt sent again recomputes
its last block to get logits; two requests decoding the same tokens fill the same blocks in
the same steps) each keep their own copy: block tables are append-only, so a block is never
swapped for an identical one. Every copy is indexed, a lookup returns one of them, and a hash
stays while any copy does: evicting one copy never strands the blocks chained after another.

A hash's value is the block itself while it has one copy, else a dict block id -> block (one
object per hash, not a dict per hash: fewer objects for the garbage collector, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.core.block_pool import KVCacheBlock


class BlockHashIndex:
    """Block hash -> its indexed copies, in indexing order. Iterating yields the hashes."""

    def __init__(self) -> None:
        self._map: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one(self, block_hash: int) -> KVCacheBlock | None:
        """A copy of ``block_hash``: one a request holds (ref count > 0) where there is one,
        since sharing it revives no free block; else the first copy indexed. None if the hash
        is not indexed."""
        entry = self._map.get(block_hash)
        if entry is None or not isinstance(entry, dict):
            return entry
        blocks = entry.values()
        return next((b for b in blocks if b.ref_cnt), next(iter(blocks)))

    def insert(self, block_hash: int, block: KVCacheBlock) -> None:
        """Index ``block`` under ``block_hash`` next to the copies already there."""
        entry = self._map.get(block_hash)
        if entry is None:
            self._map[block_hash] = block
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        elif entry is not block:
            self._map[block_hash] = {entry.block_id: entry, block.block_id: block}

    def remove(self, block_hash: int, block: KVCacheBlock) -> bool:
        """Take ``block`` out of ``block_hash``'s copies. Returns True when that removed the
        hash (it was the last copy); False when other copies remain or ``block`` was not one."""
        entry = self._map.get(block_hash)
        if entry is block:
            del self._map[block_hash]
            return True
        if not isinstance(entry, dict) or entry.pop(block.block_id, None) is not block:
            return False
        if len(entry) == 1:
            self._map[block_hash] = next(iter(entry.values()))
        return False

    def copies(self, block_hash: int) -> list[KVCacheBlock]:
        """Every block indexed under ``block_hash`` (empty if none), in indexing order."""
        entry = self._map.get(block_hash)
        if entry is None:
            return []
        return list(entry.values()) if isinstance(entry, dict) else [entry]

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._map

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)
