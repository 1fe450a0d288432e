"""The KV-cache grouping rule, the per-request capacity and the concurrency at full length,
against hand-worked layouts."""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow.core.kv_cache_utils import (
    group_kv_cache_specs,
    max_concurrency,
    max_tokens_per_request,
)
from kvflow.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

BS = 4
FULL = FullAttentionSpec(BS, 2, 8, torch.float32)


def local(window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, 2, 8, torch.float32, window=window)


def layout(groups) -> list[tuple[tuple[str, ...], int | None]]:
    return [(g.layer_names, g.kv_cache_spec.sliding_window) for g in groups]


def test_gemma3_pattern_gives_one_full_and_five_local_groups():
    kinds = ["l", "l", "l", "l", "l", "g"] * 2  # Gemma 3: five local layers, then a global one
    specs = {f"layers.{i}": FULL if k == "g" else local() for i, k in enumerate(kinds)}
    groups = group_kv_cache_specs(specs)
    assert layout(groups) == [(("layers.5", "layers.11"), None),
                              (("layers.0", "layers.1"), 8), (("layers.2", "layers.3"), 8),
                              (("layers.4", "layers.6"), 8), (("layers.7", "layers.8"), 8),
                              (("layers.9", "layers.10"), 8)]
    # A block id covers one tensor per group member: 2 layers x 2 (K, V) x 4 x 2 x 8 x 4 bytes.
    assert KVCacheConfig(10, groups).page_size_bytes == 2 * 2 * BS * 2 * 8 * 4


@pytest.mark.parametrize("specs, expected", [
    ({"a": FULL, "b": FULL}, [(("a", "b"), None)]),
    ({"a": local(), "b": local()}, [(("a", "b"), 8)]),                # Mistral: one window
    ({"a": FULL, "b": local(8), "c": local(16)}, [(("a", "b", "c"), None)]),  # windows differ
    ({"a": FULL, "b": FULL, "c": local()}, [(("a", "b", "c"), None)]),  # 1 local, 2 full
])
def test_one_group_when_spans_agree_or_do_not_divide(specs, expected):
    assert layout(group_kv_cache_specs(specs)) == expected


def test_different_block_shapes_are_refused():
    with pytest.raises(ValueError, match="KV block shape"):
        group_kv_cache_specs({"a": FULL, "b": FullAttentionSpec(BS, 4, 8, torch.float32)})
    with pytest.raises(ValueError, match="no attention layers"):
        group_kv_cache_specs({})


def test_sliding_window_block_bound_and_first_needed_block():
    spec = local(8)
    # window 8 + chunk 16 = 24 tokens = 6 blocks, plus the block the window may straddle
    assert spec.max_num_blocks(1000, 16) == 7 and spec.max_num_blocks(9, 16) == 3
    assert [spec.first_needed_block(n) for n in (0, 7, 8, 11, 12, 40)] == [0, 0, 0, 1, 1, 8]
    assert FULL.max_num_blocks(9, 16) == 3


def test_capacity_counts_full_groups_in_full_and_sliding_groups_by_window():
    one = KVCacheConfig(11, (KVCacheGroupSpec(("a",), FULL),))
    assert max_tokens_per_request(one, 16) == 10 * BS
    # 1 full + 1 sliding group over 21 usable blocks: a request of n tokens needs
    # ceil(n/4) + min(ceil(n/4), 7) blocks, so n = 14 * 4 = 56 tokens is the longest that fits.
    two = KVCacheConfig(22, (KVCacheGroupSpec(("a",), FULL), KVCacheGroupSpec(("b",), local())))
    assert max_tokens_per_request(two, 16) == 56


def test_concurrency_counts_the_blocks_one_full_length_request_holds():
    one = KVCacheConfig(11, (KVCacheGroupSpec(("a",), FULL),))
    assert max_concurrency(one, 16, 20) == 10 / 5  # 10 usable blocks, 5 per 20 tokens
    # 1 full + 1 sliding group (window 8, chunk 16: at most 7 blocks), 21 usable blocks: a
    # 16-token request holds 4 + 4 blocks, so 21 / 8 of them fit (capacity / length would
    # say 56 / 16 = 3.5); a 56-token one holds 14 + 7
    two = KVCacheConfig(22, (KVCacheGroupSpec(("a",), FULL), KVCacheGroupSpec(("b",), local())))
    assert max_concurrency(two, 16, 16) == 21 / 8
    assert max_concurrency(two, 16, 56) == 1.0
    # sliding layers only (Mistral): a request holds at most 7 blocks however long it is, so
    # three requests of the longest length (84 tokens) fit, not one
    mistral = KVCacheConfig(22, (KVCacheGroupSpec(("a",), local()),))
    assert max_tokens_per_request(mistral, 16) == 84
    assert max_concurrency(mistral, 16, 84) == 3.0


def test_startup_line_states_the_concurrency_of_a_hybrid_model(tiny_model_factory, caplog):
    """Gemma 3's tiny model (one full and one local layer, window 8) with 21 usable blocks of
    4 tokens and max_model_len 16: each request holds 4 blocks per group, so 21 / 8 = 2.6
    requests fit (the line said capacity / max_model_len: 56 / 16 = 3.5)."""
    from kvflow import LLM

    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(model=tiny_model_factory("gemma3").path, dtype="float32", device="cpu",
                  num_kv_blocks=22, block_size=BS, max_model_len=16,
                  max_num_batched_tokens=16, enforce_eager=True)
    llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "one request can hold 56 tokens, in 2 group(s); max_model_len 16; max " \
           "concurrency at full length 2.6 requests" in lines[0]
def test_sliding_window_groups_alone_hold_any_length():
    """Only sliding-window groups: a request never holds more than its window plus a chunk
    (7 blocks here, of 10 usable), so the pool holds any length; the capacity is then the
    ``limit`` asked for (it was the pool's 40 tokens, capping a longer context for no
    reason), and a full group still bounds it by its blocks."""
    sliding = KVCacheConfig(11, (KVCacheGroupSpec(("a",), local()),))
    assert max_tokens_per_request(sliding, 16, limit=4096) == 4096
    assert max_tokens_per_request(sliding, 16) == 10 * BS  # no limit: the old bound
    too_small = KVCacheConfig(7, (KVCacheGroupSpec(("a",), local()),))  # 6 usable < 7
    assert max_tokens_per_request(too_small, 16, limit=4096) == 6 * BS
    one = KVCacheConfig(11, (KVCacheGroupSpec(("a",), FULL),))
    assert max_tokens_per_request(one, 16, limit=4096) == 10 * BS
