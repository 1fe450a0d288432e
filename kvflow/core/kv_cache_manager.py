"""Maps requests to KV-cache blocks: allocation and freeing (the prefix cache, its base
class: ``core/kv_prefix_cache.py``).

The scheduler talks to this class through predicate/action pairs (``can_allocate`` /
``allocate_slots``, ``free``) and gets plain ``KVCacheBlocks`` values back; the block pool's
internals stay private.

KV-cache groups (layers with different attention spans, see ``core/kv_cache_utils.py``): one
``SingleTypeKVCacheManager`` per group keeps that group's block table of every request, all
drawn from one ``BlockPool``; every group is handled the same way, through its manager. A hit
of ``n`` blocks needs what each group's manager says it needs at ``n`` (full attention: all
leading blocks; sliding window: those inside the window).
"""

from __future__ import annotations

from kvflow.core.block_hashing import BlockHasher
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_blocks import EMPTY_BLOCKS, KVCacheBlocks
from kvflow.core.kv_prefix_cache import KVPrefixCache
from kvflow.core.single_type_kv_cache_manager import make_single_type_manager
from kvflow.kv_cache_interface import KVCacheConfig
from kvflow.request import Request


class KVCacheManager(KVPrefixCache):
    """Per-request, per-KV-cache-group block tables over one BlockPool.

    Args:
        kv_cache_config: the pool size and the KV-cache groups.
        enable_prefix_caching: reuse blocks across requests with equal prefixes.
        long_prompt_threshold: a LongRoPE model's original context (see ``KVPrefixCache``;
            None: no such model).
        hasher: the block hash (``--prefix-caching-hash-algo``; None: kvflow's ``blake2b``).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, enable_prefix_caching: bool = True,
                 long_prompt_threshold: int | None = None, hasher: BlockHasher | None = None):
        pool = BlockPool(kv_cache_config.num_blocks, enable_caching=True)
        super().__init__(pool, tuple(make_single_type_manager(g.kv_cache_spec, pool, i)
                                     for i, g in enumerate(kv_cache_config.kv_cache_groups)),
                         kv_cache_config.block_size, enable_prefix_caching,
                         long_prompt_threshold, hasher)
        self.kv_cache_config = kv_cache_config
        self._windowed = [m for m in self.managers if not m.needs_every_block]

    # ---- allocation --------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed now (see
        ``num_blocks_needed``)."""
        return self.num_blocks_needed(request, num_new_tokens, new_computed) <= \
            self.pool.num_free_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> int:
        """The free blocks ``allocate_slots`` with the same arguments would take now: new
        blocks over all groups, less those that leave a sliding window first, plus hit
        blocks that must be revived from the free queue."""
        if (new_computed is EMPTY_BLOCKS or not len(new_computed)) and \
                self._fits(request, num_new_tokens):
            return 0  # no new block in any group (the common decode step)
        computed = request.num_computed_tokens + len(new_computed) * self.block_size
        need = sum(m.num_blocks_to_allocate(request.request_id, computed + num_new_tokens,
                                            new_computed.group(g), computed)
                   for g, m in enumerate(self.managers))
        if len(new_computed):
            need += sum(1 for g in range(len(self.managers)) for b in new_computed.group(g)
                        if b.ref_cnt == 0)
        return need

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> KVCacheBlocks:
        """Give the request room for ``num_new_tokens`` more tokens (after its prefix hits).

        Returns:
            The newly allocated blocks, per group.

        Raises:
            ValueError: if there are not enough free blocks (check ``can_allocate`` first).
        """
        new = self.try_allocate_slots(request, num_new_tokens, new_computed)
        if new is None:
            raise ValueError(f"not enough KV blocks for {num_new_tokens} tokens of {request}")
        return new

    def try_allocate_slots(self, request: Request, num_new_tokens: int,
                           new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> KVCacheBlocks | None:
        """``allocate_slots``, returning None instead of raising when the pool is too small:
        one check where ``can_allocate`` + ``allocate_slots`` make two (the scheduler's
        per-request path). Returns ``empty_blocks`` when no group needs a new block."""
        rid = request.request_id
        computed = request.num_computed_tokens
        total = computed + num_new_tokens
        if new_computed is EMPTY_BLOCKS and \
                len(self._group0_blocks.get(rid, ())) * self.block_size >= total:
            # nothing to allocate (the common decode step, once per running request and
            # step: no loop over an empty list, one min())
            if self._windowed:
                for m in self._windowed:
                    m.remove_skipped_blocks(rid, computed)
            known = min(total, len(request.all_token_ids))
            if known // self.block_size > self._num_hashed.get(rid, 0):  # a block filled up
                self._cache_full_blocks(request, known)  # index it
            self._note_steady(request)
            return self.empty_blocks
        if not self.can_allocate(request, num_new_tokens, new_computed):
            return None
        if len(new_computed):
            for g, m in enumerate(self.managers):
                m.save_new_computed_blocks(rid, new_computed.group(g))
            computed += len(new_computed) * self.block_size
        for m in self.managers:
            m.remove_skipped_blocks(rid, computed)
        total_tokens = computed + num_new_tokens
        new = tuple(tuple(m.allocate_new_blocks(rid, total_tokens)) for m in self.managers)
        self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        self._note_steady(request)
        return KVCacheBlocks(new)

    def _note_steady(self, request: Request) -> None:
        """Set ``request.kv_steady_until``: the most tokens (computed + new) for which
        ``try_allocate_slots`` would do nothing but return ``empty_blocks``: those its group-0
        table holds, less one block's worth past the blocks indexed so far (its next full
        block is indexed when it fills); 0 with a sliding-window group (its leading blocks are
        released every step). Only blocks being freed (``_release``, ``free_tail``) can break
        the promise, and they reset it to 0; everything else only makes it conservative."""
        rid = request.request_id
        if self._windowed:
            request.kv_steady_until = 0
            return
        room = len(self._group0_blocks.get(rid, ())) * self.block_size
        if self._uses_hashing(request) and rid not in self._stale:
            room = min(room, (self._num_hashed.get(rid, 0) + 1) * self.block_size - 1)
        request.kv_steady_until = room

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's block tables already cover ``num_new_tokens`` more tokens
        (all groups' tables are equally long, so group 0 answers for every group)."""
        return len(self._group0_blocks.get(request.request_id, ())) * self.block_size >= \
            request.num_computed_tokens + num_new_tokens

    # ---- freeing -----------------------------------------------------------------------------
    def free_tail(self, request: Request, num_tokens: int) -> int | None:
        """Release, in every group, the blocks that lie wholly past the request's first
        ``num_tokens`` tokens (speculative decoding: blocks that held only rejected draft
        tokens). Such blocks were never indexed: only tokens below ``num_tokens`` ever are.

        Returns:
            The tables' new length in blocks, or None when nothing was released.
        """
        rid, keep = request.request_id, -(-num_tokens // self.block_size)
        if len(self._group0_blocks.get(rid, ())) <= keep:
            return None
        request.kv_steady_until = 0
        for m in reversed(self.managers):
            m.free_tail(rid, keep)
        return keep

    def free(self, request: Request) -> None:
        """Release every block of the request (last group first, each tail first, so its tail
        is evicted before its shared prefix). A request freed to be recomputed computes
        all its K/V again, so it may be indexed again (``weights_changed``)."""
        self._stale.discard(request.request_id)
        self._release(request)

    def _release(self, request: Request) -> None:
        request.kv_steady_until = 0
        self._num_hashed.pop(request.request_id, None)
        for m in reversed(self.managers):
            m.free(request.request_id)

    # ---- swap preemption ----------------------------------------------------------------------
    def detach_blocks(self, request: Request) -> tuple[list[int | None], ...]:
        """The request's block table in every group (None for null entries), then free its
        blocks as ``free`` does (swap-out: the runner copies them out before any reuse)."""
        tables = tuple([None if b is self.pool.null_block else b.block_id
                        for b in m.req_to_blocks.get(request.request_id, ())]
                       for m in self.managers)
        self._release(request)  # a stale request stays stale: its K/V come back
        return tables

    def attach_blocks(self, request: Request, present: list[list[bool]]
                      ) -> tuple[list[int | None], ...]:
        """Give a swapped-in request fresh blocks laid out as ``present`` says (per group, per
        table entry: a block, or the null block) and index its full computed blocks for
        prefix caching. Returns the new block ids per group (None for null entries).

        Raises:
            ValueError: if the pool has too few free blocks.
        """
        rid = request.request_id
        tables = []
        blocks = iter(self.pool.get_new_blocks(sum(map(sum, present))))
        for m, layout in zip(self.managers, present):
            table = [next(blocks) if held else self.pool.null_block for held in layout]
            m.restore_blocks(rid, table)
            tables.append([b.block_id if held else None for b, held in zip(table, layout)])
        self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        return tuple(tables)

    # ---- views -------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of every group (released entries read 0)."""
        return tuple(m.block_ids(request_id) for m in self.managers)

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request references in each group (null entries not counted)."""
        return [m.num_held_blocks(request_id) for m in self.managers]

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
