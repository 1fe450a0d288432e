"""One KV-cache group's blocks for every request: full attention and sliding window.

``KVCacheManager`` owns one of these per KV-cache group, all over one ``BlockPool``. The two
kinds differ in two places only:

* which leading blocks a query can still see (``first_needed_block``): all of them for full
  attention; for a sliding window W, those from ``num_computed - W + 1`` on. Blocks before
  that go back to the pool (tail of the free queue) and the null block takes their place in
  the block table, which keeps its positions;
* how a prefix hit is found: a full-attention group needs every leading block cached, a
  sliding group only the blocks inside the window before the hit point.

Each group's blocks are indexed under a group-specific key (group 0 keeps the chain hash,
group g hashes it with g), so the pool never serves one group's K/V to another.
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, KVCacheBlock, group_cache_key
from kvflow.kv_cache_interface import KVCacheSpec, SlidingWindowSpec


class SingleTypeKVCacheManager:
    """Full-attention group: every request keeps all of its blocks.

    Args:
        spec: the group's KV-cache spec.
        pool: the block pool shared by all groups.
        group_id: the group's index (its block table's index in ``block_ids``).
    """

    needs_every_block = True  # a prefix hit needs all leading blocks of this group

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    # ---- rules of this kind ------------------------------------------------------------------
    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at ``num_computed_tokens`` (or later) can see."""
        return 0

    def cache_key(self, block_hash: int) -> int:
        """The pool index key of a block with this chain hash in this group."""
        if self.group_id == 0:
            return block_hash
        return group_cache_key(block_hash, self.group_id)

    # ---- prefix cache ------------------------------------------------------------------------
    def cached_run(self, block_hashes: list[int], token_ids: list[int],
                   max_blocks: int) -> list[KVCacheBlock | None]:
        """This group's cached block (or None) for each of the first ``max_blocks`` blocks;
        stops at the first miss when every block is needed (full attention)."""
        bs, out = self.block_size, []
        for i in range(max_blocks):
            parent = self.cache_key(block_hashes[i - 1]) if i else None
            block = self.pool.get_cached_block(self.cache_key(block_hashes[i]), parent,
                                               tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None and self.needs_every_block:
                break
            out.append(block)
        return out

    def covers(self, run: list[KVCacheBlock | None], num_blocks: int) -> bool:
        """Whether ``run`` serves a hit of ``num_blocks`` leading blocks."""
        if len(run) < num_blocks:
            return False
        if self.needs_every_block:  # the run stopped at its first miss
            return True
        start = self.first_needed_block(num_blocks * self.block_size)
        return all(run[i] is not None for i in range(start, num_blocks))

    def hit_blocks(self, run: list[KVCacheBlock | None], num_blocks: int
                   ) -> tuple[KVCacheBlock, ...]:
        """The first ``num_blocks`` of ``run``, the null block where no query will look."""
        start = self.first_needed_block(num_blocks * self.block_size)
        return tuple(self.pool.null_block if i < start else run[i] for i in range(num_blocks))

    # ---- allocation --------------------------------------------------------------------------
    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed: tuple[KVCacheBlock, ...],
                               num_computed_tokens: int) -> int:
        """New blocks this group needs so the request holds ``num_tokens`` tokens, less the
        blocks it would release first (those before the window at ``num_computed_tokens``)."""
        blocks = self.req_to_blocks.get(request_id, [])
        need = max(0, -(-num_tokens // self.block_size) - len(blocks) - len(new_computed))
        return need - sum(1 for b in self._releasable(request_id, num_computed_tokens)
                          if b.ref_cnt == 1)

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed: tuple[KVCacheBlock, ...]) -> None:
        """Take a reference on the prefix-hit blocks and append them to the request's table."""
        self.pool.touch([b for b in new_computed if b is not self.pool.null_block])
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the leading blocks no query from ``num_computed_tokens`` on can see."""

    def restore_blocks(self, request_id: str, table: list[KVCacheBlock]) -> None:
        """Install a whole block table (swap-in; leading null entries are released ones)."""
        self.req_to_blocks[request_id] = table

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to cover ``num_tokens`` tokens; returns the new blocks.

        Raises:
            ValueError: if the pool has too few free blocks (check ``can_allocate`` first).
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new = self.pool.get_new_blocks(max(0, -(-num_tokens // self.block_size) - len(blocks)))
        blocks.extend(new)
        return new

    def cache_blocks(self, request_id: str, block_hashes: list[int], token_ids: list[int],
                     start: int, end: int) -> None:
        """Index the request's full blocks ``[start, end)`` (null entries skipped)."""
        bs, blocks = self.block_size, self.req_to_blocks[request_id]
        for i in range(start, end):
            if blocks[i] is self.pool.null_block:
                continue
            parent = self.cache_key(block_hashes[i - 1]) if i else None
            self.pool.cache_full_block(blocks[i], self.cache_key(block_hashes[i]), parent,
                                       tuple(token_ids[i * bs:(i + 1) * bs]))

    def free_tail(self, request_id: str, num_blocks: int) -> None:
        """Release the request's blocks past its first ``num_blocks``, last first (blocks that
        held only rejected draft tokens; never hashed, so they return as plain free blocks)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or len(blocks) <= num_blocks:
            return
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        self.pool.free_blocks([b for b in reversed(tail) if b is not self.pool.null_block])

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.pool.free_blocks([b for b in reversed(blocks) if b is not self.pool.null_block])

    # ---- views -------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table in this group (released entries read 0)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references in this group (null entries not counted)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ())
                   if b is not self.pool.null_block)

    def num_blocks(self, request_id: str) -> int:
        """Length of the request's block table in this group."""
        return len(self.req_to_blocks.get(request_id, ()))

    def _releasable(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Held blocks that lie wholly before the window at ``num_computed_tokens``."""
        return []


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window group: a request holds only the blocks its window can still see."""

    needs_every_block = False

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.window_spec = spec
        self._num_released: dict[str, int] = {}  # leading blocks already nulled, per request

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return self.window_spec.first_needed_block(num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id, [])
        released = self._num_released.get(request_id, 0)
        first = min(self.first_needed_block(num_computed_tokens), len(blocks))
        old = self._releasable(request_id, num_computed_tokens)
        blocks[released:first] = [self.pool.null_block] * max(0, first - released)
        self._num_released[request_id] = max(released, first)
        self.pool.free_blocks(old)

    def free(self, request_id: str) -> None:
        self._num_released.pop(request_id, None)
        super().free(request_id)

    def restore_blocks(self, request_id: str, table: list[KVCacheBlock]) -> None:
        super().restore_blocks(request_id, table)
        self._num_released[request_id] = next(
            (i for i, b in enumerate(table) if b is not self.pool.null_block), len(table))

    def _releasable(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id, [])
        released = self._num_released.get(request_id, 0)
        first = self.first_needed_block(num_computed_tokens)
        return [b for b in blocks[released:first] if b is not self.pool.null_block]


def make_single_type_manager(spec: KVCacheSpec, pool: BlockPool,
                             group_id: int) -> SingleTypeKVCacheManager:
    """The manager for a group of this spec's kind."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id)
    return SingleTypeKVCacheManager(spec, pool, group_id)
