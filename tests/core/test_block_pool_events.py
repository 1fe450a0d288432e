"""BlockPool's KV cache events, by hand: which blocks a BlockStored names (consecutive runs of
newly indexed blocks, each with the hash before it as parent), and what a reset reports when
some blocks are still in use (BlockRemoved for the forgotten ones) or none (AllBlocksCleared).
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, hash_block_tokens
from kvflow.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvflow.lora.request import LoRARequest

BS = 2
LOW = 2**64 - 1


def chain_hashes(tokens: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tuple(tokens[i * BS:(i + 1) * BS]))
        out.append(parent)
    return out


def index(pool: BlockPool, blocks, tokens: list[int]) -> list[int]:
    hashes = chain_hashes(tokens)
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache_full_block(b, h, hashes[i - 1] if i else None,
                              tuple(tokens[i * BS:(i + 1) * BS]))
    return hashes


def test_off_records_nothing():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(2)
    index(pool, blocks, [1, 2, 3, 4])
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.kv_events is None and pool.take_kv_events() == []


def test_runs_split_at_blocks_another_block_serves():
    pool = BlockPool(16)
    pool.enable_kv_events("GPU")
    a_tokens, b_tokens = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9, 10]
    a = pool.get_new_blocks(3)
    ha = index(pool, a, a_tokens)
    pool.record_stored(a, ha, None, BS, None, [None] * len(a))
    b = pool.get_new_blocks(4)  # same step: blocks 0-1 are copies of a's
    hb = index(pool, b, b_tokens)
    lora = LoRARequest("ad", 3, "/adapters/ad")
    pool.record_stored(b, hb, None, BS, lora, [("ad", "salt"), ("ad",), ("ad", 2), ("ad", 3)],
                       "session-b")
    events = pool.take_kv_events()
    assert events == [  # b's run: its blocks 2-3, with their own extra keys and b's session
        BlockStored([h & LOW for h in ha], None, a_tokens, BS, None, "GPU", None,
                    [None] * 3, group_idx=0),
        BlockStored([hb[2] & LOW, hb[3] & LOW], hb[1] & LOW, [7, 8, 9, 10], BS, 3, "GPU", "ad",
                    [("ad", 2), ("ad", 3)], group_idx=0, session_id="session-b")]
    assert pool.take_kv_events() == []
    pool.record_stored(a, ha, None, BS, None, [None] * len(a))  # published already: nothing again
    assert pool.take_kv_events() == []
    pool.check_invariants()


def test_reset_with_blocks_in_use_removes_only_the_free_ones():
    pool = BlockPool(8)
    pool.enable_kv_events("CPU")
    a = pool.get_new_blocks(2)
    ha = index(pool, a, [1, 2, 3, 4])
    pool.record_stored(a, ha, None, BS, None, [None] * len(a))
    pool.free_blocks([a[1]])  # a[0] stays in use
    pool.take_kv_events()
    pool.reset_prefix_cache()
    assert pool.take_kv_events() == [BlockRemoved([ha[1] & LOW], "CPU", 0)]
    pool.free_blocks([a[0]])
    pool.reset_prefix_cache()
    assert pool.take_kv_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_eviction_for_reuse_is_removed_once():
    pool = BlockPool(3)  # two usable blocks
    pool.enable_kv_events("CPU")
    a = pool.get_new_blocks(2)
    ha = index(pool, a, [1, 2, 3, 4])
    pool.record_stored(a, ha, None, BS, None, [None] * len(a))
    pool.free_blocks(list(reversed(a)))  # tail first: a[1] is evicted first
    pool.take_kv_events()
    pool.get_new_blocks(1)
    assert pool.take_kv_events() == [BlockRemoved([ha[1] & LOW], "CPU", 0)]
    pool.get_new_blocks(1)
    assert pool.take_kv_events() == [BlockRemoved([ha[0] & LOW], "CPU", 0)]
    pool.check_invariants()


def test_a_hash_with_copies_is_stored_once_and_removed_with_its_last_copy():
    """Two requests compute the same two blocks in one step, then one of them a third: the
    third's parent stays announced while any copy of it is indexed (no orphan)."""
    pool = BlockPool(8)  # usable: 1..7
    pool.enable_kv_events("CPU")
    a = pool.get_new_blocks(2)
    ha = index(pool, a, [1, 2, 3, 4])
    pool.record_stored(a, ha, None, BS, None, [None] * 2)
    b = pool.get_new_blocks(3)
    hb = index(pool, b, [1, 2, 3, 4, 5, 6])
    pool.record_stored(b, hb, None, BS, None, [None] * 3)
    assert hb[:2] == ha and all(x.block_hash == h for x, h in zip(b, hb))  # copies indexed
    assert pool.take_kv_events() == [
        BlockStored([h & LOW for h in ha], None, [1, 2, 3, 4], BS, None, "CPU", None,
                    [None] * 2, group_idx=0),
        BlockStored([hb[2] & LOW], hb[1] & LOW, [5, 6], BS, None, "CPU", None, [None],
                    group_idx=0)]
    pool.free_blocks(list(reversed(a)))
    pool.free_blocks(list(reversed(b)))  # free queue: 6, 7, a1, a0, b2, b1, b0
    taken = pool.get_new_blocks(4)  # evicts a's copies: b's serve both hashes
    assert pool.take_kv_events() == []
    assert [pool.get_cached_block(h, p, t) for h, p, t in
            zip(hb, [None, hb[0], hb[1]], [(1, 2), (3, 4), (5, 6)])] == b
    taken += pool.get_new_blocks(3)  # evicts b's blocks, the last copies, tail first
    assert pool.take_kv_events() == [BlockRemoved([hb[2] & LOW], "CPU", 0),
                                      BlockRemoved([hb[1] & LOW], "CPU", 0),
                                      BlockRemoved([hb[0] & LOW], "CPU", 0)]
    pool.check_invariants()
    pool.free_blocks(taken)


def test_reset_keeps_a_hash_whose_other_copy_is_in_use():
    pool = BlockPool(8)
    pool.enable_kv_events("CPU")
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    (h,) = index(pool, a, [1, 2])
    index(pool, b, [1, 2])
    pool.record_stored(a, [h], None, BS, None, [None])
    pool.record_stored(b, [h], None, BS, None, [None])
    assert len(pool.take_kv_events()) == 1
    pool.free_blocks(a)  # a's copy is free, b's in use
    pool.reset_prefix_cache()
    assert pool.take_kv_events() == [] and pool.get_cached_block(h, None, (1, 2)) is b[0]
    assert a[0].block_hash is None
    pool.free_blocks(b)
    pool.reset_prefix_cache()
    assert pool.take_kv_events() == [AllBlocksCleared()]
    pool.check_invariants()
