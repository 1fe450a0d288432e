"""BlockPool: allocation order, LRU eviction, ref counts, the verified prefix-cache index."""

from __future__ import annotations

import pytest

from kvflow.core.block_hash_index import BlockHashIndex
from kvflow.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens


def ids(blocks) -> list[int]:
    """Block ids of a list of blocks."""
    return [b.block_id for b in blocks]


def test_too_small_pool_raises():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocation_order_and_exhaustion(make_pool):
    pool = make_pool(6)
    assert pool.num_usable_blocks == 5 and pool.num_free_blocks == 5
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    second = pool.get_new_blocks(2)
    assert ids(second) == [4, 5]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_invariants()
    pool.free_blocks(first + second)
    assert pool.usage == 0.0


def test_null_block_is_never_handed_out(make_pool):
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    assert 0 not in ids(blocks)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    pool.free_blocks(blocks)


def test_lru_eviction_order_least_recently_freed_first(make_pool):
    pool = make_pool(6)
    b = pool.get_new_blocks(5)  # ids 1..5
    pool.free_blocks([b[2], b[0]])  # 3 then 1
    pool.free_blocks([b[4]])  # then 5
    assert ids(pool.get_new_blocks(1)) == [3]
    pool.free_blocks([b[1]])  # 2 joins the tail, behind 1 and 5
    again = pool.get_new_blocks(3)
    assert ids(again) == [1, 5, 2]
    pool.free_blocks([b[2], b[3]] + again)


def test_never_used_blocks_are_taken_before_freed_ones(make_pool):
    pool = make_pool(5)
    a = pool.get_new_blocks(2)  # 1, 2; free queue is now 3, 4
    pool.free_blocks(list(reversed(a)))  # tail-first: 2 then 1 join behind 3, 4
    taken = pool.get_new_blocks(4)
    assert ids(taken) == [3, 4, 2, 1]
    pool.free_blocks(taken)


def test_shared_block_ref_counts(make_pool):
    pool = make_pool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    pool.touch([blk])
    assert blk.ref_cnt == 3 and pool.num_free_blocks == 2
    pool.free_blocks([blk])
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2  # still held: not free
    pool.check_invariants()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.check_invariants()


def test_double_free_raises(make_pool):
    pool = make_pool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError):
        pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    pool.check_invariants()


def test_freed_cached_block_is_hit_until_evicted(make_pool):
    pool = make_pool(4)  # usable: 1, 2, 3
    toks = (10, 11, 12, 13)
    h = hash_block_tokens(None, toks)
    (blk,) = pool.get_new_blocks(1)  # id 1
    pool.cache_full_block(blk, h, None, toks)
    assert pool.get_cached_block(h, None, toks) is blk  # hit while in use
    pool.free_blocks([blk])
    assert pool.get_cached_block(h, None, toks) is blk  # freed, still cached
    # A hit revives the block: it leaves the free queue and keeps its hash.
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2 and blk.block_hash == h
    pool.free_blocks([blk])  # free queue: 2, 3, 1
    others = pool.get_new_blocks(2)
    assert ids(others) == [2, 3]
    assert pool.get_cached_block(h, None, toks) is blk  # not evicted yet
    (evicting,) = pool.get_new_blocks(1)
    assert evicting is blk
    assert pool.get_cached_block(h, None, toks) is None  # eviction removed the hash
    assert blk.block_hash is None and blk.token_ids == () and blk.parent_hash is None
    pool.check_invariants()
    pool.free_blocks(others + [evicting])


def test_hash_collision_is_verified_against_tokens(make_pool):
    pool = make_pool(4)
    a, b = pool.get_new_blocks(2)
    collide = 12345  # same hash value for two different token tuples
    toks_a, toks_b = (1, 2, 3, 4), (5, 6, 7, 8)
    pool.cache_full_block(a, collide, None, toks_a)
    assert pool.get_cached_block(collide, None, toks_b) is None  # never the wrong block
    assert pool.get_cached_block(collide, None, toks_a) is a
    assert pool.get_cached_block(collide, 999, toks_a) is None  # parent must match too
    # The second block with the colliding hash stays private: a never gets displaced and b is
    # never returned for either tuple.
    pool.cache_full_block(b, collide, None, toks_b)
    assert b.block_hash is None
    assert pool.get_cached_block(collide, None, toks_b) is None
    assert pool.get_cached_block(collide, None, toks_a) is a
    pool.free_blocks([b, a])


def test_cache_full_block_is_idempotent_and_indexes_every_copy(make_pool):
    pool = make_pool(4)
    a, b = pool.get_new_blocks(2)
    toks = (1, 2, 3, 4)
    h = hash_block_tokens(None, toks)
    pool.cache_full_block(a, h, None, toks)
    pool.cache_full_block(a, h, None, toks)
    pool.cache_full_block(b, h, None, toks)  # same content computed by another request
    assert a.block_hash == h and b.block_hash == h  # both indexed (vLLM keeps every copy)
    assert pool.get_cached_block(h, None, toks) is a  # both held: the first copy
    pool.free_blocks([a])  # a free, b held: the held copy serves (no block revived)
    assert pool.get_cached_block(h, None, toks) is b
    pool.check_invariants()
    pool.free_blocks([b])
    assert pool.get_cached_block(h, None, toks) is a  # both free: the first copy
    pool.check_invariants()


def test_evicting_one_copy_keeps_the_hash_until_the_last_goes(make_pool):
    pool = make_pool(4)  # usable: 1, 2, 3
    a, b = pool.get_new_blocks(2)  # two requests computed the same block in one step
    toks = (5, 6, 7, 8)
    h = hash_block_tokens(None, toks)
    pool.cache_full_block(a, h, None, toks)
    pool.cache_full_block(b, h, None, toks)
    pool.free_blocks([a])
    pool.free_blocks([b])  # free queue: 3, 1 (a), 2 (b)
    assert ids(pool.get_new_blocks(2)) == [3, 1]  # evicts a
    assert a.block_hash is None
    assert pool.get_cached_block(h, None, toks) is b  # b still hits
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_invariants()
    pool.free_blocks([b, pool.blocks[3], a])  # free queue: 2 (b), 3, 1
    assert ids(pool.get_new_blocks(1)) == [2]  # evicts b, the last copy
    assert pool.get_cached_block(h, None, toks) is None and h not in pool._cached
    pool.check_invariants()
    pool.free_blocks([b])


def test_caching_disabled_indexes_nothing(make_pool):
    pool = make_pool(3, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    toks = (1, 2, 3, 4)
    h = hash_block_tokens(None, toks)
    pool.cache_full_block(blk, h, None, toks)
    assert blk.block_hash is None and pool.get_cached_block(h, None, toks) is None
    pool.free_blocks([blk])


def test_reset_prefix_cache_forgets_only_free_blocks(make_pool):
    pool = make_pool(4)
    used, freed = pool.get_new_blocks(2)
    t1, t2 = (1, 1, 1, 1), (2, 2, 2, 2)
    h1, h2 = hash_block_tokens(None, t1), hash_block_tokens(None, t2)
    pool.cache_full_block(used, h1, None, t1)
    pool.cache_full_block(freed, h2, None, t2)
    pool.free_blocks([freed])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(h2, None, t2) is None
    assert pool.get_cached_block(h1, None, t1) is used
    pool.check_invariants()
    pool.free_blocks([used])


def test_hash_chain_depends_on_parent_tokens_and_extra_key():
    toks = (1, 2, 3, 4)
    h0 = hash_block_tokens(None, toks)
    assert h0 == hash_block_tokens(None, toks)
    assert h0 != hash_block_tokens(None, (1, 2, 3, 5))
    assert h0 != hash_block_tokens(h0, toks)
    assert h0 != hash_block_tokens(None, toks, "salt")


def test_block_hash_index_keeps_every_copy_until_the_last():
    blocks = [KVCacheBlock(i) for i in range(4)]
    index = BlockHashIndex()
    for b in blocks[1:]:
        index.insert(7, b)
    index.insert(7, blocks[1])  # indexed already: no second entry
    assert index.copies(7) == blocks[1:] and index.get_one(7) is blocks[1]
    blocks[3].ref_cnt = 1  # a held copy is preferred
    assert index.get_one(7) is blocks[3]
    assert index.remove(7, blocks[0]) is False  # not a copy
    assert index.remove(7, blocks[3]) is False and index.get_one(7) is blocks[1]
    assert index.remove(7, blocks[1]) is False and index.copies(7) == [blocks[2]]
    assert 7 in index and list(index) == [7] and len(index) == 1
    assert index.remove(7, blocks[2]) is True
    assert 7 not in index and index.get_one(7) is None and index.copies(7) == []
    assert index.remove(7, blocks[2]) is False
