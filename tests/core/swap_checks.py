"""Shared set-up and end checks of the swap-preemption tests (``--preemption-mode swap``):
every victim swapped, and after the run every swapped request back and both pools idle."""

from __future__ import annotations

from typing import Any

from kvflow.core.kv_swap import SwapManager


def always_swap(monkeypatch: Any) -> None:
    """Swap every victim the host pool can hold (the swap-or-recompute cost rule still runs,
    its answer ignored; tests/core/test_swap_preemption.py tests it on its own)."""
    original = SwapManager.should_swap

    def should_swap(self, request):
        original(self, request)  # still exercised
        held = sum(self.kv.num_held_blocks(request.request_id))
        return 0 < held <= self.host.num_free_blocks and request.num_computed_tokens > 0

    monkeypatch.setattr(SwapManager, "should_swap", should_swap)


def assert_swapped_back_and_pools_idle(core: Any) -> None:
    """An engine core after its run: requests were preempted and swapped out, each came back,
    and every host and device block is free (the last swap-in's host blocks are released
    first: the next step would free them)."""
    sched, kv, swap = core.scheduler, core.kv_cache_manager, core.scheduler.swap
    assert sched.num_preemptions > 0 and swap.num_swapped_out > 0
    assert swap.num_swapped_in == swap.num_swapped_out  # every swapped request came back
    swap.release_read_blocks()
    assert swap.host.num_free_blocks == swap.host.num_blocks and not swap.swapped
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
