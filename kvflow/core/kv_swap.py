"""Swap preemption, scheduler side: a host pool of KV blocks and the cost rule.

With ``--preemption-mode swap`` a preempted request's KV blocks are copied to host memory
(a second pool of ``--swap-space`` bytes; on CPU simply another tensor) instead of being freed
for recomputation, when the copy costs less than recomputing the context:

    swap:      2 x tokens x kv_bytes_per_token / SWAP_BYTES_PER_S   (out now, back in later)
    recompute: the step-time model's prefill time for the request's computed tokens
               (t(n, 0, n (n + 1) / 2) - c0), or, before the model is fitted, swap from
               SWAP_MIN_TOKENS_UNFITTED tokens on

so a long context is swapped and a short one recomputed. The copies are the runner's job: the
scheduler lists (device block, host block) pairs in ``SchedulerOutput.blocks_to_swap_out`` and
(host block, device block) pairs in ``blocks_to_swap_in``; the runner copies every swap-out
before every swap-in and both before the step's forward writes any K/V, so device blocks freed
by a swap-out may be handed out in the same step. Host blocks read by a swap-in are freed when
the next step is scheduled (``release_read_blocks``), after the runner has read them.

A swapped request keeps ``num_computed_tokens``; readmitted, it gets fresh device blocks with
the same layout (null entries of a sliding window stay null) and resumes where it stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.step_time_model import StepTimeModel, chunk_context_tokens
from kvflow.request import Request

SWAP_BYTES_PER_S = 4e9  # host <-> device copy rate assumed (a conservative memcpy / PCIe)
SWAP_MIN_TOKENS_UNFITTED = 256


class HostBlockPool:
    """Host block ids ``0 .. num_blocks - 1``, handed out and freed in FIFO order.

    Args:
        num_blocks: blocks of host memory.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks.

        Raises:
            ValueError: if fewer are free.
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} host blocks, only {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


@dataclass
class SwappedKV:
    """Where a swapped-out request's blocks are: per KV-cache group, one host block id per
    block-table entry (None where the entry was the null block)."""

    host_tables: tuple[list[int | None], ...]

    @property
    def host_blocks(self) -> list[int]:
        return [h for table in self.host_tables for h in table if h is not None]


class SwapManager:
    """Swapped requests, their host blocks, and the swap-or-recompute choice.

    Args:
        kv: the device KV-cache manager.
        num_host_blocks: size of the host pool (``--swap-space`` / bytes per block).
        kv_bytes_per_token: KV bytes one token occupies across all layers.
        model: the scheduler's step-time model (for the cost of recomputing).
    """

    def __init__(self, kv: KVCacheManager, num_host_blocks: int, kv_bytes_per_token: int,
                 model: StepTimeModel) -> None:
        self.kv, self.model = kv, model
        self.host = HostBlockPool(num_host_blocks)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.swapped: dict[str, SwappedKV] = {}
        self._release_next: list[int] = []  # host blocks read by this step's swap-ins
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def holds(self, request: Request) -> bool:
        return request.request_id in self.swapped

    def should_swap(self, request: Request) -> bool:
        """Swap (rather than recompute) this victim: the copy is cheaper and fits the host
        pool."""
        held = sum(self.kv.num_held_blocks(request.request_id))
        n = request.num_computed_tokens
        if n == 0 or held == 0 or held > self.host.num_free_blocks:
            return False
        if not self.model.is_ready:
            return n >= SWAP_MIN_TOKENS_UNFITTED
        swap_s = 2 * n * self.kv_bytes_per_token / SWAP_BYTES_PER_S
        recompute_s = self.model.predict_raw(n, 0, chunk_context_tokens(0, n)) - \
            float(self.model.coef[0])
        return swap_s < recompute_s

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's device blocks to host blocks (their device blocks are freed;
        the runner copies them before anything overwrites them). Returns (device, host)
        pairs."""
        tables = self.kv.detach_blocks(request)
        pairs: list[tuple[int, int]] = []
        host_tables = []
        for table in tables:
            held = [b for b in table if b is not None]
            hosts = iter(self.host.allocate(len(held)))
            host_table = [None if b is None else next(hosts) for b in table]
            pairs += [(b, h) for b, h in zip(table, host_table) if b is not None]
            host_tables.append(host_table)
        self.swapped[request.request_id] = SwappedKV(tuple(host_tables))
        self.num_swapped_out += 1
        return pairs

    def blocks_needed(self, request: Request, num_new: int) -> int:
        """Device blocks a swap-in plus ``num_new`` more tokens take (an upper bound)."""
        swapped = self.swapped[request.request_id]
        bs = self.kv.block_size
        total = -(-(request.num_computed_tokens + num_new) // bs)
        return len(swapped.host_blocks) + sum(max(0, total - len(t))
                                              for t in swapped.host_tables)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Give the swapped request fresh device blocks laid out as before; returns (host,
        device) pairs. Its host blocks are freed at the next step (``release_read_blocks``).

        Raises:
            ValueError: if the device pool is short (check with ``num_blocks_to_swap_in``).
        """
        swapped = self.swapped.pop(request.request_id)
        tables = self.kv.attach_blocks(request, [[h is not None for h in t]
                                                 for t in swapped.host_tables])
        pairs = [(h, d) for host_table, table in zip(swapped.host_tables, tables)
                 for h, d in zip(host_table, table) if h is not None]
        self._release_next += swapped.host_blocks
        self.num_swapped_in += 1
        return pairs

    def drop(self, request_id: str) -> None:
        """Forget a swapped request that finished (abort) and free its host blocks."""
        swapped = self.swapped.pop(request_id, None)
        if swapped is not None:
            self.host.free(swapped.host_blocks)

    def release_read_blocks(self) -> None:
        """Scheduling a new step: the previous step's swap-ins were copied, so the host blocks
        they read are free again."""
        if self._release_next:
            self.host.free(self._release_next)
            self._release_next = []
