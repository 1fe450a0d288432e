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

Layers with different attention spans (KV-cache groups): the manager keeps one block list per
group, all drawn from one BlockPool. Group 0 is usually the full-attention layers; a group with
a ``sliding_window`` W (Gemma 3's local layers, Mistral) only ever reads the last W positions,
so before each allocation the leading blocks that lie wholly before ``num_computed - W + 1``
are released to the pool and replaced by the null block in that group's block table. A group's
blocks are hashed under a group-specific key, so a prefix hit is looked up per group: full
groups need the whole leading run, sliding groups only the blocks inside the window before the
hit point (see ``get_computed_blocks``). The model runner maps each group to its own layers
(docs/architecture.md, "Layers with different attention spans").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from kvflow.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """An ordered run of blocks handed to the scheduler (valid until the request is freed).

    ``blocks`` belong to KV-cache group 0; ``other_groups`` holds the same run for groups 1..
    (equally long; leading blocks outside a sliding window are the null block).
    """

    blocks: tuple[KVCacheBlock, ...] = ()
    other_groups: tuple[tuple[KVCacheBlock, ...], ...] = ()

    def group(self, g: int) -> tuple[KVCacheBlock, ...]:
        return self.blocks if g == 0 else (self.other_groups[g - 1] if self.other_groups
                                           else ())

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


EMPTY_BLOCKS = KVCacheBlocks()


class KVCacheManager:
    """Per-request, per-KV-cache-group block lists over one BlockPool.

    Args:
        num_blocks: blocks in the pool, including the reserved null block.
        block_size: tokens per block.
        enable_prefix_caching: reuse blocks across requests with equal prefixes.
        group_windows: one entry per KV-cache group: None for full attention, else the
            group's sliding window in tokens. Default: one full-attention group.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,)):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.group_windows = tuple(group_windows)
        self._groups = range(len(self.group_windows))
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}  # group 0
        self._group_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # groups 1..
        self._num_released: dict[str, list[int]] = {}  # leading blocks nulled, per group
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
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached = [self._cached_run(request, g, max_blocks) for g in self._groups]
        num_hit = self._longest_hit(cached, max_blocks)
        null = self.pool.null_block
        runs = tuple(tuple(null if i < self._first_needed(g, num_hit * self.block_size)
                           else cached[g][i] for i in range(num_hit)) for g in self._groups)
        if self.enable_prefix_caching and request.num_cached_tokens < 0:  # count once
            self.num_queries += request.num_tokens
            self.num_hits += num_hit * self.block_size
        return KVCacheBlocks(runs[0], runs[1:]), num_hit * self.block_size

    def _cached_run(self, request: Request, g: int, max_blocks: int) -> list:
        """Group ``g``'s cached block (or None) for each of the first ``max_blocks`` blocks;
        a full-attention group stops at its first miss."""
        bs, tokens, out = self.block_size, request.all_token_ids, []
        for i in range(max_blocks):
            parent = self._group_key(request.block_hashes[i - 1], g) if i else None
            block = self.pool.get_cached_block(self._group_key(request.block_hashes[i], g),
                                               parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None and self.group_windows[g] is None:
                break
            out.append(block)
        return out

    def _longest_hit(self, cached: list[list], max_blocks: int) -> int:
        """Most leading blocks ``n`` such that every full group has blocks ``[0, n)`` cached
        and every sliding group the blocks its window needs at position ``n * block_size``."""
        longest = min([max_blocks] + [len(c) for g, c in enumerate(cached)
                                      if self.group_windows[g] is None])
        sliding = [(g, c) for g, c in enumerate(cached) if self.group_windows[g] is not None]
        for n in range(longest, 0, -1):
            if all(c[i] is not None for g, c in sliding
                   for i in range(self._first_needed(g, n * self.block_size), n)):
                return n
        return 0

    def _group_key(self, block_hash: int, g: int) -> int:
        """Group 0 keeps the chain hash; group g > 0 hashes it with its group id, so the pool's
        index never serves one group's KV to another."""
        return block_hash if g == 0 else hash_block_tokens(block_hash, (), ("kv_group", g))

    def _first_needed(self, g: int, num_computed: int) -> int:
        """Index of group g's first block that a query at position ``num_computed`` (or later)
        can still see: keys from ``num_computed - window + 1`` on (0 for full attention)."""
        window = self.group_windows[g]
        return 0 if window is None else max(0, (num_computed - window + 1) // self.block_size)

    # ---- allocation --------------------------------------------------------------------------
    def _lists(self, request_id: str) -> list[list[KVCacheBlock]]:
        """The request's block list of every group (group 0 first), created on first use."""
        if request_id not in self._req_blocks:
            self._req_blocks[request_id] = []
            self._group_blocks[request_id] = [[] for _ in self._groups[1:]]
            self._num_released[request_id] = [0 for _ in self._groups]
        return [self._req_blocks[request_id], *self._group_blocks[request_id]]

    def _num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                                new_computed: KVCacheBlocks) -> int:
        """New blocks over all groups, less those that leave a sliding window first."""
        computed = request.num_computed_tokens + len(new_computed) * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        held = request.request_id in self._req_blocks
        lists = self._lists(request.request_id) if held else [[] for _ in self._groups]
        released = self._num_released[request.request_id] if held else [0 for _ in lists]
        need = 0
        for g, blocks in enumerate(lists):
            need += max(0, total - len(blocks) - len(new_computed))
            need -= sum(1 for b in blocks[released[g]:self._first_needed(g, computed)]
                        if b.ref_cnt == 1 and b is not self.pool.null_block)
        return need

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed: KVCacheBlocks = EMPTY_BLOCKS) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed now."""
        revived = sum(1 for g in self._groups for b in new_computed.group(g) if b.ref_cnt == 0)
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
        lists = self._lists(request.request_id)
        null = self.pool.null_block
        for g, blocks in enumerate(lists):
            hits = new_computed.group(g)
            self.pool.touch([b for b in hits if b is not null])
            blocks.extend(hits)
        computed = request.num_computed_tokens + len(new_computed) * self.block_size
        self._release_out_of_window(request.request_id, lists, computed)
        total_tokens = computed + num_new_tokens
        new_by_group = []
        for blocks in lists:
            new_blocks = self.pool.get_new_blocks(
                max(0, -(-total_tokens // self.block_size) - len(blocks)))
            blocks.extend(new_blocks)
            new_by_group.append(new_blocks)
        self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        return KVCacheBlocks(tuple(new_by_group[0]))

    def _release_out_of_window(self, request_id: str, lists: list[list[KVCacheBlock]],
                               num_computed: int) -> None:
        """Free each sliding group's leading blocks that no query from ``num_computed`` on can
        see, leaving the null block in their place (the table keeps its positions)."""
        released, null = self._num_released[request_id], self.pool.null_block
        for g, blocks in enumerate(lists):
            first = min(self._first_needed(g, num_computed), len(blocks))
            old = [b for b in blocks[released[g]:first] if b is not null]
            blocks[released[g]:first] = [null] * max(0, first - released[g])
            released[g] = max(released[g], first)
            self.pool.free_blocks(old)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self._uses_hashing(request):
            return
        self._update_block_hashes(request)
        bs, tokens, hashes = self.block_size, request.all_token_ids, request.block_hashes
        lists = self._lists(request.request_id)
        start = self._num_hashed.get(request.request_id, 0)
        end = min(num_tokens // bs, len(lists[0]))
        for g, blocks in enumerate(lists):
            for i in range(start, end):
                if blocks[i] is self.pool.null_block:
                    continue
                parent = self._group_key(hashes[i - 1], g) if i else None
                self.pool.cache_full_block(blocks[i], self._group_key(hashes[i], g), parent,
                                           tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_hashed[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so its tail is evicted first)."""
        if request.request_id not in self._req_blocks:
            return
        lists = self._lists(request.request_id)
        for mapping in (self._req_blocks, self._group_blocks, self._num_released,
                        self._num_hashed):
            mapping.pop(request.request_id, None)
        null = self.pool.null_block
        for blocks in reversed(lists):
            self.pool.free_blocks([b for b in reversed(blocks) if b is not null])

    # ---- views -------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table (the only one when every layer has the same span)."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Block tables of groups 1.. (empty with one group); released blocks read 0."""
        return [[b.block_id for b in blocks] for blocks in self._group_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request references in each group (null entries not counted)."""
        if request_id not in self._req_blocks:
            return [0 for _ in self._groups]
        return [sum(1 for b in blocks if b is not self.pool.null_block)
                for blocks in self._lists(request_id)]

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
