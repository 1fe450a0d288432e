"""The pool of KV-cache blocks: ref counts, an LRU free queue, and the prefix-cache index.

Invariants (checked by ``check_invariants`` in tests):
  * a block is in the free queue iff its ref count is 0 (block 0, the null block, is never
    handed out: padded block-table entries point at it);
  * a block is in the hash index iff it holds a full block of tokens whose hash it carries;
    freed blocks stay indexed (and can be hit again) until they are evicted for reuse;
  * a hash maps to every block indexed under it (``core/block_hash_index.py``: copies that
    requests computed apart), all holding the same (parent, tokens); a lookup returns one of
    them, and the hash leaves the index only with its last copy;
  * the free queue is in eviction order: least recently freed first, and a request's blocks are
    freed tail-first so its last blocks are evicted before its shared prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.block_hash_index import BlockHashIndex
from kvflow.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
)

if TYPE_CHECKING:
    from kvflow.lora.request import LoRARequest


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # What the hash stands for, kept to verify hits (a hash alone is never trusted).
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...],
                      extra_key: object = None) -> int:
    """Chain hash of a full block: it identifies the block's tokens *and* its whole prefix.

    A cryptographic hash (BLAKE2b, 128 bits), not Python's ``hash``: a collision in an earlier
    block would otherwise let a later block be reused after a different prefix (the per-block
    token check cannot see that), and tuple hashes of ints are easy to collide on purpose.

    Args:
        parent_hash: hash of the previous block of the sequence (None for the first block).
        token_ids: the block's ``block_size`` token ids.
        extra_key: anything else that changes the KV (e.g. a cache salt); hashable.

    The hashed bytes are unambiguous: a parent flag (and the parent's 16 bytes), the token
    count, the tokens as int64, then ``repr(extra_key)`` when there is one.
    """
    payload = (b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little")) \
        + len(token_ids).to_bytes(4, "little") + array("q", token_ids).tobytes()
    if extra_key is not None:
        payload += repr(extra_key).encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=16).digest(), "little")


def group_cache_key(block_hash: int, group_id: int) -> int:
    """The pool key of a block of KV-cache group ``group_id`` > 0 whose chain hash is
    ``block_hash`` (any algorithm's, up to 256 bits): BLAKE2b-128 of both, so groups never
    share a key. Group 0 keys its blocks by the chain hash itself."""
    payload = b"kv_group" + group_id.to_bytes(4, "little") + block_hash.to_bytes(32, "little")
    return int.from_bytes(hashlib.blake2b(payload, digest_size=16).digest(), "little")


class BlockPool:
    """Owns ``num_blocks`` KVCacheBlocks; block 0 is the reserved null block.

    Args:
        num_blocks: total blocks, including the null block (>= 2).
        enable_caching: keep an index from block hash to block for prefix caching.

    Raises:
        ValueError: if num_blocks < 2.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self._cached = BlockHashIndex()
        # KV cache events (off: None, and nothing below creates an event)
        self.kv_events: list[KVCacheEvent] | None = None
        self._published: set[int] = set()  # hashes announced by a BlockStored
        self._medium: str | None = None

    def enable_kv_events(self, medium: str) -> None:
        """Record KV cache events from now on (``take_kv_events`` drains them); ``medium``
        is where the blocks live ("GPU", "CPU")."""
        self.kv_events, self._medium = [], medium

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, possibly still holding cached KV)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by running requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: int, parent_hash: int | None,
                         token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """Return a cached block for this exact (prefix, tokens), verified, or None: a copy a
        request holds where there is one (sharing it costs no free block), else the first
        copy indexed."""
        block = self._cached.get_one(block_hash)  # every copy holds the same (parent, tokens)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    # ---- actions -----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting cached KV).

        Raises:
            ValueError: if fewer blocks are free (callers check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix hit); revive it from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in
        the given order (so pass a request's blocks tail-first: they are evicted first).

        Raises:
            ValueError: on a double free (a block with no reference) or the null block.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: int, parent_hash: int | None,
                         token_ids: tuple[int, ...]) -> None:
        """Index a block that now holds a full block of tokens, next to any copies already
        indexed under ``block_hash`` (no-op if caching is off or the block is indexed; a block
        whose hash collides with other tokens or another parent stays private)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        other = self._cached.get_one(block_hash)
        if other is not None and (other.parent_hash, other.token_ids) != (parent_hash, token_ids):
            return  # a collision: never serve one content under another's hash
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached.insert(block_hash, block)

    def record_stored(self, blocks: list[KVCacheBlock], hashes: list[int],
                      parent_hash: int | None, block_size: int, lora: LoRARequest | None,
                      extra_keys: list[tuple | None], session_id: str | None = None) -> None:
        """Publish (``BlockStored``) the blocks of one request's chain that ``cache_full_block``
        just indexed: ``blocks[i]`` is the chain's block of hash ``hashes[i]`` and event extra
        keys ``extra_keys[i]``, the first one following ``parent_hash``; ``lora`` is the
        request's adapter, ``session_id`` its session (vLLM 0.32's request field; None: none). A hash is announced once, whatever its copies: a block not indexed
        under its hash (the null block, a collision) or whose hash was published already (by
        another copy) splits the run: each event is a consecutive chain. Call only with events
        on.
        """
        run: list[int] = []  # indices into blocks
        for i, (block, h) in enumerate(zip(blocks, hashes)):
            if h not in self._published and block.block_hash == h:
                run.append(i)
                continue
            self._store_run([blocks[j] for j in run], parent_hash, block_size, lora,
                            [extra_keys[j] for j in run], session_id)
            run, parent_hash = [], h
        self._store_run([blocks[j] for j in run], parent_hash, block_size, lora,
                        [extra_keys[j] for j in run], session_id)

    def _store_run(self, run: list[KVCacheBlock], parent_hash: int | None, block_size: int,
                   lora: LoRARequest | None, extra_keys: list[tuple | None],
                   session_id: str | None) -> None:
        if not run:
            return
        self._published.update(b.block_hash for b in run)
        self.kv_events.append(BlockStored(
            block_hashes=[external_block_hash(b.block_hash) for b in run],
            parent_block_hash=None if parent_hash is None else external_block_hash(parent_hash),
            token_ids=[t for b in run for t in b.token_ids], block_size=block_size,
            lora_id=lora.lora_int_id if lora is not None else None, medium=self._medium,
            lora_name=lora.lora_name if lora is not None else None, extra_keys=extra_keys,
            group_idx=0, session_id=session_id))

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (empty with events off)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def record_all_blocks_cleared(self) -> None:
        """Put ``AllBlocksCleared`` before every event not yet taken (events on; else a
        no-op): the blocks a previous publisher announced are gone (a restarted engine
        core's first batch), this pool's own events follow."""
        if self.kv_events is not None:
            self.kv_events.insert(0, AllBlocksCleared())

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        """Forget the cached prefix of each of ``blocks`` (free or held; other copies of the
        same hash stay; ``BlockRemoved`` once a published hash has no copy left)."""
        for block in blocks:
            self._evict_hash(block)

    def indexed_keys(self) -> set[int]:
        """Every key (hash, or group key) with a block indexed under it now."""
        return set(self._cached)

    def uncache_keys(self, keys: set[int]) -> None:
        """Forget every copy indexed under each of ``keys`` (free or held; a key not indexed
        is skipped; ``BlockRemoved`` for each published one)."""
        for key in keys:
            for block in list(self._cached.copies(key)):
                self._evict_hash(block)

    def reset_prefix_cache(self, held_too: bool = False) -> None:
        """Forget every cached prefix held by free blocks (used blocks keep their hashes),
        or, with ``held_too``, by every block (a weight change: no K/V of the old weights
        may serve a hit, and a held block freed later joins the free queue unindexed).
        With events on: ``AllBlocksCleared`` when no published block is left, else one
        ``BlockRemoved`` per published hash left with no copy (a copy in use keeps it)."""
        num_events = len(self.kv_events) if self.kv_events is not None else 0
        indexed = self.blocks[1:] if held_too else list(self._free.values())
        for block in indexed:
            if block.block_hash is not None:
                self._evict_hash(block)
        if self.kv_events is not None and not self._published:
            del self.kv_events[num_events:]
            self.kv_events.append(AllBlocksCleared())

    def _evict_hash(self, block: KVCacheBlock) -> None:
        """Take the block out of the index; its hash goes (``BlockRemoved`` if published) when
        it was the last copy."""
        h = block.block_hash
        last = h is not None and self._cached.remove(h, block)
        if last and self.kv_events is not None and h in self._published:
            self._published.discard(h)
            self.kv_events.append(BlockRemoved(block_hashes=[external_block_hash(h)],
                                               medium=self._medium, group_idx=0))
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def check_invariants(self) -> None:
        """Assert the pool's invariants (for tests). Raises AssertionError on a violation."""
        assert self.null_block.ref_cnt == 1 and 0 not in self._free
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
        indexed = 0
        for h in self._cached:
            copies = self._cached.copies(h)
            assert copies, h
            for block in copies:
                assert block.block_hash == h, block
                assert (block.parent_hash, block.token_ids) == \
                    (copies[0].parent_hash, copies[0].token_ids), block
            indexed += len(copies)
        assert indexed == sum(1 for b in self.blocks if b.block_hash is not None)
        assert all(h in self._cached for h in self._published)
