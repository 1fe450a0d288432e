"""The prefix-cache half of :class:`kvflow.core.kv_cache_manager.KVCacheManager` (its base
class): each request's block hashes, the lookup of cached leading blocks, the indexing of a
request's full blocks as they fill, and what stops being indexed (a weight change, an unloaded
LoRA adapter, blocks whose K/V failed to load); KV cache events.

Every full block of a request's tokens gets a chain hash (see ``core/block_hashing.py``:
kvflow's or vLLM's). When a request is first scheduled, the longest run of its leading full
blocks already in the pool is reused (ref count + 1) instead of recomputed; at least one token
is always left to compute so the step has logits to sample from. Blocks are indexed as soon as
they are allocated for tokens that this step computes, which is safe because every layer writes
the step's new K/V before it reads any. With prefix caching off, the ``n`` samples of one
request still share their prompt blocks: their hashes carry the parent request id as an extra
key, so only siblings can hit them. A block holding image placeholder tokens also carries the
images' identifiers (hashes of their pixels), so the same text with another image never hits.
A request with a LoRA adapter adds the adapter to the extra key: the same tokens under another
adapter (or none) have other K/V. A request's ``cache_salt`` (vLLM's) is added to the extra key
of its first block only, as vLLM mixes it in: every later block chains from that hash, so only
requests with the same salt share any block; an unsalted request's hashes are unchanged.

KV cache events (``enable_kv_events``): the blocks of group 0 (full attention where the model
has any) that join or leave the prefix cache, keyed by the chain hash a router can follow;
other groups' blocks are indexed under group keys (``cache_key``) no router computes.
"""

from __future__ import annotations

from kvflow.core.block_hashing import BlockHasher, event_extra_keys
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_blocks import KVCacheBlocks
from kvflow.core.kv_events import KVCacheEvent
from kvflow.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from kvflow.request import Request


class KVPrefixCache:
    """The prefix cache over one pool's block tables (``KVCacheManager`` adds allocation and
    freeing, and keeps ``_num_hashed`` and ``_stale`` per request as it frees).

    Args:
        pool: the block pool every group draws from.
        managers: one block-table manager per KV-cache group (group 0 first).
        block_size: tokens per block.
        enable_prefix_caching: reuse blocks across requests with equal prefixes.
        long_prompt_threshold: a LongRoPE model's original context: the keys of a longer
            prompt are rotated differently (long factors at every position,
            ``kvflow/layers/rotary.py: LongPromptRope``), so its blocks are cached apart from
            a shorter prompt's (None: no such model).
        hasher: the block hash (``--prefix-caching-hash-algo``; None: kvflow's ``blake2b``).
    """

    def __init__(self, pool: BlockPool, managers: tuple[SingleTypeKVCacheManager, ...],
                 block_size: int, enable_prefix_caching: bool,
                 long_prompt_threshold: int | None, hasher: BlockHasher | None) -> None:
        self.pool, self.managers, self.block_size = pool, managers, block_size
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.long_prompt_threshold = long_prompt_threshold
        self.enable_prefix_caching = enable_prefix_caching
        self.empty_blocks = KVCacheBlocks(tuple(() for _ in managers))
        self._group0_blocks = managers[0].req_to_blocks  # each request's group-0 table
        self._num_hashed: dict[str, int] = {}  # leading blocks of each request already indexed
        # requests whose K/V predate a weight change: none of their blocks is indexed again
        self._stale: set[str] = set()
        # pool keys indexed for each LoRA adapter id (some evicted since): forget_adapter
        self._adapter_keys: dict[int, set[int]] = {}
        self.num_queries = 0  # prefix-cache lookups, in tokens
        self.num_hits = 0  # prefix-cache hits, in tokens

    # ---- lookup ------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks not hashed yet (``core/block_hashing.py``): the
        extra key is None for ordinary prefix caching; the parent id when only siblings may
        share; a LoRA adapter (it changes every layer's K/V); for a LongRoPE prompt longer
        than the original context, a mark (its keys' rotations differ); for a prompt given as
        embeddings, their digest (its placeholder token ids say nothing of its K/V); the
        images a block holds; the salt on block 0."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        if len(hashes) >= len(tokens) // bs:
            return
        hasher = self.hasher
        long_prompt = self.long_prompt_threshold is not None and \
            request.num_prompt_tokens > self.long_prompt_threshold
        request_key = hasher.request_key(request, self.enable_prefix_caching, long_prompt)
        for i in range(len(hashes), len(tokens) // bs):
            key = hasher.block_extra_key(request_key, request, i * bs, (i + 1) * bs)
            hashes.append(hasher.hash_block(hashes[i - 1] if i else None,
                                            tuple(tokens[i * bs:(i + 1) * bs]), key))

    def _uses_hashing(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.request_id != request.parent_id

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached run of the request's leading full blocks.

        Returns:
            (blocks, num_computed_tokens): the hit blocks (not yet referenced: pass them to
            ``allocate_slots``) and how many tokens they cover. At most ``num_tokens - 1``.
            Nothing is counted here (a request may be looked up on many steps before it
            fits): ``count_prefix_query`` counts its admission.
        """
        if not self._uses_hashing(request) or request.skips_prefix_cache:
            return self.empty_blocks, 0
        runs, num_hit = self._find_hit(request)
        if num_hit == 0:
            return self.empty_blocks, 0
        hits = tuple(m.hit_blocks(run, num_hit) for m, run in zip(self.managers, runs))
        return KVCacheBlocks(hits), num_hit * self.block_size

    def count_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's first admission into the prefix-cache counters: its tokens
        looked up and the ``num_hit_tokens`` found (requests that do not look up the shared
        prefix cache, those asking for prompt logprobs or per-token pooling, count nothing)."""
        if self.enable_prefix_caching and not request.skips_prefix_cache:
            self.num_queries += request.num_tokens
            self.num_hits += num_hit_tokens

    def peek_computed_tokens(self, request: Request) -> int:
        """The tokens ``get_computed_blocks`` would find cached now, without counting a
        prefix-cache query (admission control's estimate)."""
        if not self._uses_hashing(request) or request.skips_prefix_cache:
            return 0
        return self._find_hit(request)[1] * self.block_size

    def _find_hit(self, request: Request) -> tuple[list, int]:
        """Each group's cached run and the number of leading blocks every group covers."""
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        runs = [m.cached_run(request.block_hashes, request.all_token_ids, max_blocks)
                for m in self.managers]
        num_hit = next((n for n in range(max_blocks, 0, -1)
                        if all(m.covers(run, n) for m, run in zip(self.managers, runs))), 0)
        return runs, num_hit

    # ---- indexing ----------------------------------------------------------------------------
    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        start = self._num_hashed.get(rid, 0)
        end = min(num_tokens // self.block_size, len(self._group0_blocks.get(rid, ())))
        if end <= start or not self._uses_hashing(request) or rid in self._stale:
            return
        self._update_block_hashes(request)
        for m in self.managers:
            m.cache_blocks(rid, request.block_hashes, request.all_token_ids, start, end)
        self._num_hashed[rid] = end
        if request.lora_request is not None:
            self._note_adapter_keys(request.lora_request.lora_int_id,
                                    request.block_hashes[start:end])
        if self.pool.kv_events is not None:
            self._record_stored(request, start, end)

    def _note_adapter_keys(self, lora_int_id: int, hashes: list[int]) -> None:
        """Remember the pool keys of ``hashes`` (every group's) as the adapter's; the keys
        evicted since are dropped whenever the set outgrows the pool twice over."""
        keys = self._adapter_keys.setdefault(lora_int_id, set())
        keys.update(m.cache_key(h) for m in self.managers for h in hashes)
        if len(keys) > 2 * self.pool.num_blocks:
            keys.intersection_update(self.pool.indexed_keys())

    def _record_stored(self, request: Request, start: int, end: int) -> None:
        """Publish group 0's blocks ``[start, end)`` of the request that are now indexed."""
        hashes, bs = request.block_hashes, self.block_size
        self.pool.record_stored(self._group0_blocks[request.request_id][start:end],
                                hashes[start:end], hashes[start - 1] if start else None, bs,
                                request.lora_request,
                                [event_extra_keys(request, i * bs, (i + 1) * bs)
                                 for i in range(start, end)], request.session_id)

    # ---- forgetting --------------------------------------------------------------------------
    def uncache_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks (ids of group 0) out of the prefix cache: their K/V are not
        what their hashes say (a KV connector load that failed)."""
        self.pool.uncache([self.pool.blocks[i] for i in sorted(block_ids)])

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes of every free block (blocks a request holds keep
        theirs: see ``EngineCore.reset_prefix_cache``, ``BlockPool.reset_prefix_cache``)."""
        self.pool.reset_prefix_cache()

    def weights_changed(self, request_ids: set[str]) -> None:
        """The model's weights changed (``reload_weights``): forget every cached prefix,
        the blocks requests hold included, and index nothing more of the requests whose
        K/V the old weights computed (``request_ids``, e.g. a swapped-out request's, and
        every request holding blocks now): their later blocks attend over old K/V. Such a
        request may be indexed again once it is freed for recompute (``free``)."""
        self._stale |= set(request_ids) | set(self._group0_blocks)
        self.pool.reset_prefix_cache(held_too=True)

    def forget_adapter(self, lora_int_id: int, request_ids: set[str]) -> None:
        """A LoRA adapter was unloaded: its folder may hold other weights at its next load
        (under the same name and folder, which vLLM's hashes key, or the same id): forget
        every block indexed under it, held ones included, and index nothing more of the
        ``request_ids`` (those still running with it)."""
        self._stale |= request_ids
        self.pool.uncache_keys(self._adapter_keys.pop(lora_int_id, set()))

    # ---- KV cache events ---------------------------------------------------------------------
    def enable_kv_events(self, medium: str) -> None:
        """Record KV cache events (``kvflow/core/kv_events.py``) of the prefix cache from now
        on; ``medium`` is where the blocks live ("GPU", "CPU").

        Raises:
            ValueError: with prefix caching off (only a request's own samples could share
                its blocks: nothing a router could route to).
        """
        if not self.enable_prefix_caching:
            raise ValueError("kv_events_config enable_kv_cache_events=true needs prefix "
                             "caching, and this engine runs without it (turned off, or a model that "
                             "keeps no KV cache or pools more than its last token)")
        self.pool.enable_kv_events(medium)

    def record_all_blocks_cleared(self) -> None:
        """Lead the next events with ``AllBlocksCleared`` (``BlockPool.
        record_all_blocks_cleared``; nothing with events off)."""
        self.pool.record_all_blocks_cleared()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call, oldest first (none when off)."""
        return self.pool.take_kv_events()
