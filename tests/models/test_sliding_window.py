"""Sliding-window attention in the paged KV cache: exact against HF, bounded memory.

Prompts several windows long run through the engine with chunked prefill and prefix caching;
the greedy tokens and logprobs must equal HF's, and after every step the blocks a request
holds in a sliding-window KV-cache group must stay within the window plus one chunk, however
long the sequence grows. Also unit tests of the KV-cache manager's groups (fake config, no
model) and of the LongRoPE table against transformers.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from tests.core.fake_kv import fake_kv_cache_config
from tests.models.test_parity import _prompts, assert_matches_hf, greedy

WINDOW, BS, BUDGET = 8, 4, 16  # the tiny specs' window; block size; token budget per step


def _bound(window: int, chunk: int, block_size: int) -> int:
    """Most blocks a sliding group can hold for one request: its window plus one step's
    chunk, rounded up, plus a block the window may straddle."""
    return -(-(window + chunk) // block_size) + 1


def _track_held_blocks(llm: LLM) -> list[dict[str, list[int]]]:
    """Record, after every engine step, the blocks each running request holds per group."""
    core, history = llm.engine.core, []
    step = core.step

    def recording_step():
        out = step()
        kv = core.kv_cache_manager
        history.append({r.request_id: kv.num_held_blocks(r.request_id)
                        for r in core.scheduler.running})
        return out

    core.step = recording_step
    return history


@pytest.mark.parametrize("name", ["gemma3", "mistral_sliding_window"])
def test_long_prompt_matches_hf_with_bounded_window_blocks(name, tiny_model_factory,
                                                           assert_no_leaks):
    """Prompts of 7-8 windows (chunked 16 tokens a step), run twice on one engine so the
    second run takes prefix-cache hits; tokens equal HF's both times."""
    tiny = tiny_model_factory(name)
    llm = LLM(model=tiny.path, dtype="float32", num_kv_blocks=128, block_size=BS,
              max_num_seqs=4, max_num_batched_tokens=BUDGET, enable_prefix_caching=True)
    windows = [g.kv_cache_spec.sliding_window
               for g in llm.engine.core.kv_cache_config.kv_cache_groups]
    assert WINDOW in windows  # mistral: one sliding group; gemma3: full + sliding groups
    history = _track_held_blocks(llm)
    prompts = _prompts([61, 57], tiny.vocab_size, seed=11)
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    second = llm.generate(prompts, greedy(), use_tqdm=False)
    for a, b in zip(first, second):
        assert_matches_hf(tiny, a)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.engine.core.kv_cache_manager.num_hits > 0
    bound = _bound(WINDOW, BUDGET, BS)
    peak = [max(held[g] for step in history for held in step.values())
            for g in range(len(windows))]
    for g, window in enumerate(windows):
        if window is not None:
            assert peak[g] <= bound, (name, peak, bound)
        else:  # full attention keeps every block of the longest sequence (61 + 10 tokens)
            assert peak[g] == -(-(61 + 10 - 1) // BS)
    assert_no_leaks(llm)


def test_sliding_window_model_serves_contexts_longer_than_the_pool(tiny_model_factory,
                                                                    assert_no_leaks):
    """A model whose every layer is windowed (Mistral's layout) holds at most its window plus
    one chunk per request: a pool of 7 usable blocks (28 tokens, the window of 8 plus a chunk
    of 4 needs 4) serves prompts of 33-50 tokens and 20 more, as HF computes them, preempting
    under the pressure and leaking nothing. ``max_model_len`` was capped at the pool's 28
    tokens and these prompts refused."""
    tiny = tiny_model_factory("mistral_sliding_window")
    llm = LLM(model=tiny.path, dtype="float32", num_kv_blocks=8, block_size=BS,
              max_model_len=96, max_num_batched_tokens=4)
    assert llm.engine.core.max_model_len == 96
    prompts = _prompts([40, 33, 50], tiny.vocab_size, seed=3)
    for out in llm.generate(prompts, greedy(20), use_tqdm=False):
        assert_matches_hf(tiny, out, 20)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


# ---- the KV-cache manager's groups, without a model ---------------------------------------

def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), eos_token_id=None)


def _prefill(kv: KVCacheManager, req: Request, chunk: int) -> None:
    """What the scheduler does for a new request: hits, then chunks of ``chunk`` tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    n = min(chunk, req.num_tokens - num_hit)
    kv.allocate_slots(req, n, hits)
    req.num_computed_tokens = num_hit + n
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        kv.allocate_slots(req, n)
        req.num_computed_tokens += n


def test_sliding_group_releases_blocks_and_hits_need_only_the_window():
    kv = KVCacheManager(fake_kv_cache_config(64, BS, (None, WINDOW)), enable_prefix_caching=True)
    prompt = list(range(100, 140))  # 40 tokens = 10 blocks
    a = _request("a", prompt)
    _prefill(kv, a, chunk=8)
    full, local = kv.num_held_blocks("a")
    assert full == 10 and local <= _bound(WINDOW, 8, BS)
    table = kv.get_block_ids("a")[1]
    assert table[:5] == [0] * 5 and 0 not in table[-2:]  # released leading blocks read 0
    kv.free(a)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    # Same prompt + more: the full group hits 10 blocks; the local group had its early
    # blocks released (still cached, not needed) and keeps its window's blocks cached.
    b = _request("b", prompt + [7, 8, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40
    local_hits = hits.group(1)
    needed_from = (40 - WINDOW + 1) // BS
    assert all(blk is kv.pool.null_block for blk in local_hits[:needed_from])
    assert all(blk is not kv.pool.null_block for blk in local_hits[needed_from:])
    kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    kv.free(b)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_hit_stops_where_the_window_blocks_were_evicted():
    """If a sliding group's in-window blocks were evicted, the hit falls back to a shorter
    prefix whose window blocks are all still cached (here: none, so no hit)."""
    kv = KVCacheManager(fake_kv_cache_config(64, BS, (None, WINDOW)), enable_prefix_caching=True)
    prompt = list(range(200, 224))  # 6 blocks
    a = _request("a", prompt)
    _prefill(kv, a, chunk=24)
    kv.free(a)
    local_keys = {kv.managers[1].cache_key(h) for h in a.block_hashes}
    for block in kv.pool.blocks[1:]:  # evict the local group's blocks only
        if block.ref_cnt == 0 and block.block_hash in local_keys:
            kv.pool._evict_hash(block)
    hits, num_hit = kv.get_computed_blocks(_request("b", prompt + [1]))
    assert num_hit == 0 and len(hits) == 0


def test_can_allocate_counts_blocks_released_this_step():
    """A full pool: the decode that starts block 11 needs one new block per group, and the
    window moving past blocks 6 and 7 frees two local blocks first, so it still fits."""
    kv = KVCacheManager(fake_kv_cache_config(1 + 14, BS, (None, WINDOW)),
                        enable_prefix_caching=False)
    a = _request("a", list(range(1, 41)))  # 40 tokens = 10 blocks
    _prefill(kv, a, chunk=8)
    assert kv.num_held_blocks("a") == [10, 4] and kv.num_free_blocks == 0
    a.append_output_token(5)  # token 41 starts block 11 in both groups
    assert kv.can_allocate(a, 1)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert kv.num_held_blocks("a") == [11, 3] and kv.num_free_blocks == 0
    kv.free(a)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


# ---- LongRoPE -------------------------------------------------------------------------------

def test_longrope_table_matches_transformers():
    """Below original_max_position_embeddings kvflow's table uses the short factors, from it
    on the long ones, each equal to transformers' LongRoPE frequencies and attention factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvflow.models.llama import make_rotary_embedding

    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                        original_max_position_embeddings=64, partial_rotary_factor=0.5,
                        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
                                      "long_factor": [2.0, 3.0, 6.0, 9.0]})
    rope = make_rotary_embedding(config)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    for seq_len, positions in ((None, torch.arange(0, 64)), (65, torch.arange(64, 256))):
        inv_freq, scale = init(config, "cpu", seq_len=seq_len)
        freqs = positions.float().unsqueeze(1) * inv_freq
        expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale
        torch.testing.assert_close(rope.cos_sin_cache[positions], expected)
