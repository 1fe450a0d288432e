"""KVCacheManager: prefix hits, allocation predicates vs actions, sibling sharing, counters."""

from __future__ import annotations

import random

import pytest

from kvflow.core.block_pool import hash_block_tokens
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.lora.request import LoRARequest
from kvflow.request import Request

BS = 4  # block size used throughout (the conftest default)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """Do what the scheduler does for a new request: look up hits, allocate, count the
    lookup, advance.

    Computes ``num_new`` tokens after the hits (default: all the rest) and returns the hit length.
    """
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    kv.allocate_slots(req, num_new, hits)
    kv.count_prefix_query(req, num_hit)
    req.num_computed_tokens = num_hit + num_new
    return num_hit


def decode(kv: KVCacheManager, req: Request, token: int) -> None:
    """Append one sampled token and compute it, as a decode step does."""
    req.append_output_token(token)
    kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1


def ref_counts(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    """Current ref counts of the given block ids."""
    return [kv.pool.blocks[b].ref_cnt for b in block_ids]


def test_allocation_covers_exactly_the_tokens(make_kv, make_request):
    kv = make_kv(10)
    req = make_request("a", list(range(5)))
    assert admit(kv, req) == 0
    assert kv.get_block_ids("a")[0] == [1, 2]  # 5 tokens -> 2 blocks
    decode(kv, req, 50)  # 6 tokens
    decode(kv, req, 51)  # 7
    decode(kv, req, 52)  # 8: still 2 blocks
    assert kv.get_block_ids("a")[0] == [1, 2]
    decode(kv, req, 53)  # 9 -> third block
    assert kv.get_block_ids("a")[0] == [1, 2, 3]
    assert kv.num_free_blocks == 6
    kv.free(req)
    assert kv.get_block_ids("a")[0] == []


@pytest.mark.parametrize("prefix_len, extra, expected_hit", [
    (8, [90, 91, 92, 93], 8),  # block-aligned shared prefix
    (10, [90, 91], 8),  # shared prefix ends mid-block: only the full blocks hit
    (3, [90, 91, 92, 93, 94], 0),  # shorter than a block: nothing
    (12, [], 8),  # identical prompt: the last token is never a hit
    (12, [90], 12),  # one token more: all three blocks hit
])
def test_prefix_hit_length(make_kv, make_request, prefix_len, extra, expected_hit):
    kv = make_kv(20)
    base = list(range(100, 112))
    a = make_request("a", base)
    admit(kv, a)
    b = make_request("b", base[:prefix_len] + extra)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == expected_hit and len(hits) == expected_hit // BS
    assert hits.get_block_ids()[0] == kv.get_block_ids("a")[0][:expected_hit // BS]
    kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert kv.get_block_ids("b")[0][:len(hits)] == hits.get_block_ids()[0]
    shared = hits.get_block_ids()[0]
    assert ref_counts(kv, shared) == [2] * len(shared)
    private = kv.get_block_ids("b")[0][len(hits):]
    assert ref_counts(kv, private) == [1] * len(private)
    kv.free(a)
    assert ref_counts(kv, shared) == [1] * len(shared)
    kv.free(b)


@pytest.mark.parametrize("num_tokens", range(1, 14))
def test_hits_never_cover_the_last_token(make_kv, make_request, num_tokens):
    kv = make_kv(20)
    prompt = list(range(200, 200 + num_tokens))
    a = make_request("a", prompt + [7, 7, 7, 7])  # caches every block of ``prompt`` and more
    admit(kv, a)
    b = make_request("b", prompt)
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == (num_tokens - 1) // BS * BS
    assert num_hit < num_tokens
    kv.free(a)


def test_only_computed_blocks_are_hit(make_kv, make_request):
    kv = make_kv(20)
    prompt = list(range(16))
    a = make_request("a", prompt)
    admit(kv, a, num_new=6)  # a chunk: only block 0 holds computed tokens
    b = make_request("b", prompt + [1])
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    kv.allocate_slots(a, 6)  # next chunk: 12 computed
    a.num_computed_tokens = 12
    assert kv.get_computed_blocks(b)[1] == 12
    kv.free(a)


def test_hits_survive_free_until_evicted_tail_first(make_kv, make_request):
    kv = make_kv(5)  # usable blocks 1..4
    prompt = list(range(300, 312))
    a = make_request("a", prompt)
    admit(kv, a)
    assert kv.get_block_ids("a")[0] == [1, 2, 3]
    kv.free(a)  # free queue: 4, then a's blocks tail-first: 3, 2, 1
    b = make_request("b", prompt + [5])
    assert kv.get_computed_blocks(b)[1] == 12  # all still cached after free
    x = make_request("x", [9] * 8)
    admit(kv, x)  # takes two blocks from the head: 4, then 3 (a's last block) is evicted
    assert kv.get_block_ids("x")[0] == [4, 3]
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hits.get_block_ids()[0] == [1, 2]
    kv.free(x)


def test_hit_on_free_blocks_revives_them(make_kv, make_request):
    kv = make_kv(5)
    prompt = list(range(12))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", prompt + [1, 2, 3, 4])  # 16 tokens, 12 hit, 4 new
    assert kv.can_allocate(b, 4, kv.get_computed_blocks(b)[0])
    assert admit(kv, b) == 12
    assert kv.get_block_ids("b")[0] == [1, 2, 3, 4]
    assert ref_counts(kv, [1, 2, 3, 4]) == [1, 1, 1, 1] and kv.num_free_blocks == 0
    kv.free(b)


def test_revived_hits_count_against_free_blocks(make_kv, make_request):
    kv = make_kv(4)  # usable 1..3
    prompt = list(range(8))
    a = make_request("a", prompt)
    admit(kv, a)  # blocks 1, 2
    kv.free(a)
    b = make_request("b", prompt + [1, 2, 3, 4, 5])  # 13 tokens: 8 hit, 5 new -> 2 new blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 2 revived + 2 new blocks > 3 free
    assert not kv.can_allocate(b, 5, hits)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 3 and kv.get_block_ids("b")[0] == []  # nothing taken
    assert kv.can_allocate(b, 4, hits)  # 12 tokens -> 1 new block
    kv.allocate_slots(b, 4, hits)
    assert kv.num_free_blocks == 0
    kv.free(b)


def test_allocate_slots_failure_leaves_state_unchanged(make_kv, make_request):
    kv = make_kv(3)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    a.append_output_token(5)
    assert not kv.can_allocate(a, 1)
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a")[0] == [1, 2]
    kv.free(a)


def test_prefix_caching_off_no_hits_across_requests(make_kv, make_request):
    kv = make_kv(20, enable_prefix_caching=False)
    prompt = list(range(13))
    a = make_request("a", prompt)
    admit(kv, a)
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 0 and len(hits) == 0
    # Same prompt under a different parent: still no hit.
    c = make_request("c-0", prompt, parent_id="c")
    assert kv.get_computed_blocks(c)[1] == 0
    assert kv.num_queries == 0 and kv.num_hits == 0
    kv.free(a)


def test_prefix_caching_off_siblings_share_prompt_blocks(make_kv, make_request):
    kv = make_kv(20, enable_prefix_caching=False)
    prompt = list(range(13))  # 3 full blocks + 1 token
    s0 = make_request("p-0", prompt, parent_id="p", sample_index=0, arrival=0.0)
    s1 = make_request("p-1", prompt, parent_id="p", sample_index=1, arrival=0.0)
    s2 = make_request("p-2", prompt, parent_id="p", sample_index=2, arrival=0.0)
    assert admit(kv, s0) == 0
    assert admit(kv, s1) == 12
    assert admit(kv, s2) == 12
    b0, b1, b2 = (kv.get_block_ids(r)[0] for r in ("p-0", "p-1", "p-2"))
    assert b0[:3] == b1[:3] == b2[:3]
    assert ref_counts(kv, b0[:3]) == [3, 3, 3]
    assert len({b0[3], b1[3], b2[3]}) == 3  # the partial tail block is private
    assert ref_counts(kv, [b0[3], b1[3], b2[3]]) == [1, 1, 1]
    # Unrelated requests with the same prompt do not see the siblings' blocks: neither an n=1
    # request nor a sample of another n>1 request.
    assert kv.get_computed_blocks(make_request("q", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("r-0", prompt, parent_id="r"))[1] == 0
    for r in (s0, s1, s2):
        kv.free(r)
    assert ref_counts(kv, b0[:3]) == [0, 0, 0]


def test_siblings_do_not_share_diverged_output_blocks(make_kv, make_request):
    kv = make_kv(20, enable_prefix_caching=False)
    prompt = list(range(4))
    s0 = make_request("p-0", prompt, parent_id="p")
    s1 = make_request("p-1", prompt, parent_id="p", sample_index=1)
    admit(kv, s0)
    admit(kv, s1)  # 4 tokens: no hit (last token is never a hit)
    for t in (10, 11, 12, 13):
        decode(kv, s0, t)
    for t in (10, 11, 99, 13):
        decode(kv, s1, t)
    late = make_request("p-2", prompt + [10, 11, 12, 13, 14], parent_id="p", sample_index=2)
    hits, num_hit = kv.get_computed_blocks(late)
    assert num_hit == 8
    assert hits.get_block_ids()[0][1] == kv.get_block_ids("p-0")[0][1]
    assert kv.get_block_ids("p-0")[0][1] != kv.get_block_ids("p-1")[0][1]
    kv.free(s0)
    kv.free(s1)


def test_query_and_hit_counters(make_kv, make_request):
    kv = make_kv(20)
    base = list(range(12))
    a = make_request("a", base)
    admit(kv, a)
    assert (kv.num_queries, kv.num_hits) == (12, 0)
    b = make_request("b", base + [1])  # 13 tokens, 12 hit
    admit(kv, b)
    assert (kv.num_queries, kv.num_hits) == (25, 12)
    c = make_request("c", base[:6])  # 6 tokens, 4 hit
    admit(kv, c)
    assert (kv.num_queries, kv.num_hits) == (31, 16)
    for r in (a, b, c):
        kv.free(r)


def _random_trial(kv: KVCacheManager, make_request, rng: random.Random, num_ops: int) -> None:
    """Random admissions, chunks, decodes and frees over a tiny pool.

    ``can_allocate`` must predict ``allocate_slots`` exactly (a refused allocation changes
    nothing), ref counts must match the requests' block tables, and a simulated KV cache (each
    slot holds the token written there) must read back every request's own tokens, so every
    prefix hit is checked against the content it stands for.
    """
    live: list[Request] = []
    mem: dict[tuple[int, int], int] = {}  # (block id, slot) -> token written there
    for step in range(num_ops):
        op = rng.random()
        if op < 0.35 or not live:
            prompt = [rng.choice((1, 2)) for _ in range(rng.randint(1, 14))]
            parent = rng.choice((None, "p0", "p1"))  # None: an n=1 request
            req = make_request(f"r{step}", prompt, parent_id=parent)
            hits, num_hit = kv.get_computed_blocks(req)
            assert num_hit < req.num_tokens and num_hit % kv.block_size == 0
            num_new = rng.randint(1, req.num_tokens - num_hit)
            if _try_allocate(kv, req, num_new, hits, num_hit, mem):
                live.append(req)
        elif op < 0.8:
            req = rng.choice(live)
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(rng.choice((1, 2)))
            num_new = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            _try_allocate(kv, req, num_new, None, req.num_computed_tokens, mem)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        _check_refs(kv, live)
    for req in live:
        kv.free(req)


def _try_allocate(kv, req, num_new, hits, start, mem) -> bool:
    """Check ``can_allocate`` against ``allocate_slots``; on success write and verify KV."""
    ok = kv.can_allocate(req, num_new, *(() if hits is None else (hits,)))
    before = (kv.num_free_blocks, kv.get_block_ids(req.request_id)[0])
    args = (req, num_new) if hits is None else (req, num_new, hits)
    if not ok:
        with pytest.raises(ValueError):
            kv.allocate_slots(*args)
        assert (kv.num_free_blocks, kv.get_block_ids(req.request_id)[0]) == before
        return False
    kv.allocate_slots(*args)
    end = start + num_new
    req.num_computed_tokens = end
    bs, table = kv.block_size, kv.get_block_ids(req.request_id)[0]
    assert len(table) == -(-end // bs)
    for pos in range(start, end):
        mem[(table[pos // bs], pos % bs)] = req.all_token_ids[pos]
    assert [mem.get((table[p // bs], p % bs)) for p in range(end)] == req.all_token_ids[:end]
    return True


def _check_refs(kv: KVCacheManager, live: list[Request]) -> None:
    """Ref counts equal the number of live requests whose block table holds the block."""
    counts: dict[int, int] = {}
    for req in live:
        for b in kv.get_block_ids(req.request_id)[0]:
            counts[b] = counts.get(b, 0) + 1
    for block in kv.pool.blocks[1:]:
        assert block.ref_cnt == counts.get(block.block_id, 0)
    kv.pool.check_invariants()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("caching", [True, False])
def test_can_allocate_agrees_with_allocate_slots_randomized(make_kv, make_request, seed,
                                                           caching):
    rng = random.Random(seed)
    kv = make_kv(rng.randint(2, 12), block_size=rng.choice([1, 2, 4, 4]),
                 enable_prefix_caching=caching)
    _random_trial(kv, make_request, rng, num_ops=150)


def test_cache_salt_shares_blocks_only_within_one_salt(make_kv, make_request):
    """vLLM's ``cache_salt``: mixed into the first block's hash only, so a request hits the
    blocks of earlier requests with the same salt (here 13 tokens: 3 whole blocks, 12 tokens)
    and none of another salt's or of unsalted requests'; unsalted requests keep plain chain
    hashes and share among themselves."""
    kv = make_kv(40)
    prompt = list(range(13))
    reqs = {rid: make_request(rid, prompt, cache_salt=salt)
            for rid, salt in (("a", "alice"), ("b", "alice"), ("c", "bob"), ("d", None),
                              ("e", None))}
    assert [admit(kv, r) for r in reqs.values()] == [0, 12, 0, 0, 12]
    first = reqs["a"]
    assert kv.get_computed_blocks(make_request("f", prompt, cache_salt="carol"))[1] == 0
    # the hash chain, recomputed by hand: unsalted blocks hash their tokens alone; a salted
    # request's block 0 carries the salt and its later blocks only chain from it
    plain = [hash_block_tokens(None, tuple(prompt[:4]))]
    for i in (1, 2):
        plain.append(hash_block_tokens(plain[-1], tuple(prompt[4 * i:4 * i + 4])))
    unsalted = make_request("g", prompt)
    kv.get_computed_blocks(unsalted)
    assert unsalted.block_hashes == plain
    salted = first.block_hashes
    assert salted[0] != plain[0]
    assert salted[1] == hash_block_tokens(salted[0], tuple(prompt[4:8]))
    assert salted[2] == hash_block_tokens(salted[1], tuple(prompt[8:12]))
    for r in reqs.values():
        kv.free(r)


def test_weights_changed_forgets_held_blocks_and_indexes_no_old_kv(make_kv, make_request):
    """After ``weights_changed`` no block serves a hit: the blocks a running request holds
    are forgotten (freed unindexed), its later full blocks are not indexed (they attend over
    old K/V), nor is a swapped-out request's K/V when it comes back; a request freed for
    recompute is indexed again (its K/V are all the new weights')."""
    kv = make_kv(20)
    running, swapped, prompt = make_request("run", list(range(9))), \
        make_request("swap", list(range(100, 109))), list(range(9))
    admit(kv, running)  # 2 full blocks indexed, held
    admit(kv, swapped)
    layout = kv.detach_blocks(swapped)  # swap-out: its 2 full blocks stay cached, free
    assert len(list(kv.pool._cached)) == 4

    kv.weights_changed({"swap"})
    assert not list(kv.pool._cached)
    for t in range(7):  # 16 tokens: 2 more full blocks of the running request
        decode(kv, running, 50 + t)
    kv.attach_blocks(swapped, [[b is not None for b in layout[0]]])
    assert not list(kv.pool._cached)
    kv.free(running)
    kv.free(swapped)
    assert not list(kv.pool._cached)
    kv.pool.check_invariants()
    later = make_request("later", prompt)
    assert admit(kv, later) == 0  # no hit on the old K/V
    assert len(list(kv.pool._cached)) == 2  # the new weights' blocks are indexed
    kv.free(later)

    preempted = make_request("again", list(range(200, 209)))
    admit(kv, preempted)
    kv.weights_changed(set())  # it holds blocks: stale without being named
    kv.free(preempted)  # preempted by recompute: computes everything again
    preempted.num_computed_tokens = 0
    admit(kv, preempted)
    assert len(list(kv.pool._cached)) == 2  # indexed again
    kv.free(preempted)


def test_forget_adapter_uncaches_its_blocks_only_and_its_running_requests(make_kv,
                                                                          make_request):
    """An unloaded adapter's blocks, free or held, leave the index (its folder may hold other
    weights at the next load under the same key); the base model's and another adapter's
    stay; the request still running with it indexes nothing more."""
    kv = make_kv(30)
    reqs = {}
    for rid, lora, start in [("done", 7, 0), ("run", 7, 100), ("other", 8, 200),
                             ("base", None, 300)]:
        reqs[rid] = req = make_request(rid, list(range(start, start + 9)))
        req.lora_request = None if lora is None else LoRARequest(f"a{lora}", lora, f"/a{lora}")
        admit(kv, req)  # 2 full blocks each
    kv.free(reqs["done"])
    assert len(list(kv.pool._cached)) == 8

    kv.forget_adapter(7, {"run"})
    kept = {b.block_hash for r in ("other", "base") for b in kv.pool.blocks
            if b.block_id in kv.get_block_ids(r)[0] and b.block_hash is not None}
    assert set(kv.pool._cached) == kept and len(kept) == 4
    for t in range(7):  # 16 tokens: 2 more full blocks, not indexed
        decode(kv, reqs["run"], 50 + t)
    assert set(kv.pool._cached) == kept
    kv.pool.check_invariants()
    for rid in ("run", "other", "base"):
        kv.free(reqs[rid])
    again = make_request("again", list(range(9)))  # "done"'s prompt and adapter id
    again.lora_request = LoRARequest("a7", 7, "/a7")
    assert admit(kv, again) == 0
    kv.free(again)
