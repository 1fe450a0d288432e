"""Maps requests to KV-cache blocks: allocation, prefix-cache lookups, freeing.

The scheduler talks to this class through predicate/action pairs (``can_allocate`` /
``allocate_slots``, ``free``) and gets plain ``KVCacheBlocks`` values back; the block pool's
internals stay private.

Prefix caching: every full block of a request's tokens gets a chain hash (see
``hash_block_tokens``). When a request is first scheduled, the longest run of its leading full
blocks already in the pool is reused (ref count + 1) instead of recomputed; at least one token is
always left to compute so the step has logits to sample from. Blocks are indexed as soon as they
are allocated for tokens that this step computes, which is safe because every layer writes the
step's new K/V before it reads any. With prefix caching off, the ``n`` samples of one request
still share their prompt blocks: their hashes carry the parent request id as an extra key, so
only siblings can hit them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from kvflow.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """An ordered run of blocks handed to the scheduler (valid until the request is freed)."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


EMPTY_BLOCKS = KVCacheBlocks()


class KVCacheManager:
    """Per-request block lists over one BlockPool.

    Args:
        num_blocks: blocks in the pool, including the reserved null block.
        block_size: tokens per block.
        enable_prefix_caching: reuse blocks across requests with equal prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of each request already indexed
        self.num_queries = 0  # prefix-cache lookups, in tokens
        self.num_hits = 0  # prefix-cache hits, in tokens

    # ---- prefix cache ------------------------------------------------------------------------
    def _cache_extra_key(self, request: Request) -> object | None:
        """None for ordinary prefix caching; the parent id when only siblings may share."""
        return None if self.enable_prefix_caching else request.parent_id

    def _uses_hashing(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.request_id != request.parent_id

    def _update_block_hashes(self, request: Request) -> None:
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        extra = self._cache_extra_key(request)
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached run of the request's leading full blocks.

        Returns:
            (blocks, num_computed_tokens): the hit blocks (not yet referenced: pass them to
            ``allocate_slots``) and how many tokens they cover. At most ``num_tokens - 1``.
        """
        if not self._uses_hashing(request):
            return EMPTY_BLOCKS, 0
        self._update_block_hashes(request)
        bs, tokens, hits = self.block_size, request.all_token_ids, []
        for i in range((request.num_tokens - 1) // bs):
            parent = request.block_hashes[i - 1] if i else None
            block = self.pool.get_cached_block(
                request.block_hashes[i], parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        if self.enable_prefix_caching and request.num_cached_tokens < 0:  # count once
            self.num_queries += request.num_tokens
            self.num_hits += len(hits) * bs
        return KVCacheBlocks(tuple(hits)), len(hits) * bs

    # ---- allocation --------------------------------------------------------------------------
    def _num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                                new_computed: KVCacheBlocks) -> int:
        held = len(self._req_blocks.get(request.request_id, ())) + len(new_computed)
        total_tokens = (request.num_computed_tokens + len(new_computed) * self.block_size
                        + num_new_tokens)
        return max(0, -(-total_tokens // self.block_size) - held)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed now."""
        revived = sum(1 for b in new_computed.blocks if b.ref_cnt == 0)
        need = self._num_blocks_to_allocate(request, num_new_tokens, new_computed) + revived
        return need <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> KVCacheBlocks:
        """Give the request room for ``num_new_tokens`` more tokens (after its prefix hits).

        Raises:
            ValueError: if there are not enough free blocks (check ``can_allocate`` first).
        """
        if not self.can_allocate(request, num_new_tokens, new_computed):
            raise ValueError(f"not enough KV blocks for {num_new_tokens} tokens of {request}")
        blocks = self._req_blocks.setdefault(request.request_id, [])
        self.pool.touch(list(new_computed.blocks))
        blocks.extend(new_computed.blocks)
        total_tokens = (request.num_computed_tokens + len(new_computed) * self.block_size
                        + num_new_tokens)
        new_blocks = self.pool.get_new_blocks(
            max(0, -(-total_tokens // self.block_size) - len(blocks)))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        return KVCacheBlocks(tuple(new_blocks))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self._uses_hashing(request):
            return
        self._update_block_hashes(request)
        blocks, bs, tokens = self._req_blocks[request.request_id], self.block_size, \
            request.all_token_ids
        start = self._num_hashed.get(request.request_id, 0)
        end = min(num_tokens // bs, len(blocks))
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else None
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], parent,
                                       tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_hashed[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so its tail is evicted first)."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    # ---- views -------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
