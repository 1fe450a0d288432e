"""The EAGLE / MTP head's store of the target's hidden states (``FeatureStash``): per request,
only the rows the head will still read (at most a verification step's k + 1), in one buffer
indexed by request slot (kvflow/spec_decode/eagle.py explains which rows and why)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch


class FeatureStash:
    """The target's final hidden states the head has still to read: per request, the
    consecutive positions ``begin .. begin + count - 1``, at most ``capacity`` of them (k + 1:
    a verification step's tokens), in one buffer [slots, capacity, H] of the target's dtype
    that grows (doubling) with the requests held at once. Every request's bookkeeping is a
    numpy column indexed by its slot, so a step is stored and read with one tensor index.

    Memory: ``slots * capacity * H`` values, e.g. Llama-3-8B (H 4096, bf16) with 256
    requests and k = 3: 8 MiB, whatever the prompts' and outputs' lengths."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None  # [slots, capacity, H], made on first store
        self.slot: dict[str, int] = {}
        self.begin = np.full(0, -1, np.int64)  # first kept position; -1: none stored yet
        self.count = np.zeros(0, np.int64)  # rows kept
        self.offset = np.zeros(0, np.int64)  # the buffer row of ``begin``
        self._free: list[int] = []

    def slots_of(self, req_ids: list[str], like: torch.Tensor) -> np.ndarray:
        """int64 [len(req_ids)]: each request's slot, a free one given to a new request (the
        buffer grows, shaped and typed after ``like`` [*, H], when none is free)."""
        new = [rid for rid in dict.fromkeys(req_ids) if rid not in self.slot]
        if len(new) > len(self._free):
            self._grow(len(self.slot) + len(new), like)
        for rid in new:
            s = self.slot[rid] = self._free.pop()
            self.begin[s], self.count[s], self.offset[s] = -1, 0, 0
        return np.fromiter((self.slot[rid] for rid in req_ids), np.int64, len(req_ids))

    def _grow(self, needed: int, like: torch.Tensor) -> None:
        old = 0 if self.buffer is None else self.buffer.shape[0]
        size = max(needed, 2 * old, 4)
        buffer = torch.zeros(size, self.capacity, like.shape[-1], dtype=like.dtype,
                             device=like.device)
        if self.buffer is not None:
            buffer[:old] = self.buffer
        self.buffer = buffer
        grown = size - old
        self.begin = np.concatenate([self.begin, np.full(grown, -1, np.int64)])
        self.count = np.concatenate([self.count, np.zeros(grown, np.int64)])
        self.offset = np.concatenate([self.offset, np.zeros(grown, np.int64)])
        self._free.extend(range(size - 1, old - 1, -1))

    def store(self, slots: np.ndarray, begin: np.ndarray, features: torch.Tensor,
              first_row: np.ndarray, count: np.ndarray) -> None:
        """Keep, for each ``slots[i]``, only the positions ``begin[i] .. begin[i] + count[i]
        - 1``: rows ``first_row[i] ..`` of ``features`` [T, H] (one index copy).

        Raises:
            RuntimeError: for a count over ``capacity`` (a bookkeeping error).
        """
        if (count > self.capacity).any():
            raise RuntimeError(f"EAGLE: {int(count.max())} target features to keep for one "
                               f"request, more than the stash's {self.capacity}")
        self.begin[slots], self.count[slots], self.offset[slots] = begin, count, 0
        within = ramp(count)
        dest = np.repeat(slots * self.capacity, count) + within
        src = np.repeat(first_row, count) + within
        flat = self.buffer.view(-1, self.buffer.shape[-1])
        with _serial_on_cpu(flat):
            flat.index_copy_(0, torch.from_numpy(dest).to(flat.device),
                             features.index_select(0, torch.from_numpy(src).to(features.device)))

    def drop_before(self, slots: np.ndarray, position: np.ndarray) -> None:
        """Forget the rows of positions before ``position[i]`` (consumed by the head)."""
        cut = np.minimum(np.maximum(position - self.begin[slots], 0), self.count[slots])
        self.begin[slots] += cut
        self.offset[slots] += cut
        self.count[slots] -= cut

    def take(self, slots: np.ndarray, start: np.ndarray, count: np.ndarray) -> torch.Tensor:
        """Rows of positions ``start[i] .. start[i] + count[i] - 1`` of each slot, in order:
        [sum(count), H] (one index select).

        Raises:
            RuntimeError: if some of them are not kept (a bookkeeping error).
        """
        begin, kept = self.begin[slots], self.count[slots]
        bad = np.flatnonzero((begin < 0) | (start < begin) | (start + count > begin + kept))
        if len(bad):
            i = int(bad[0])
            rid = next(r for r, s in self.slot.items() if s == slots[i])
            raise RuntimeError(f"EAGLE: request {rid!r} has target features for positions "
                               f"{begin[i]}..{begin[i] + kept[i] - 1}, not {start[i]}.."
                               f"{start[i] + count[i] - 1}")
        rows = np.repeat(slots * self.capacity + self.offset[slots] + start - begin, count) \
            + ramp(count)
        flat = self.buffer.view(-1, self.buffer.shape[-1])
        with _serial_on_cpu(flat):
            return flat.index_select(0, torch.from_numpy(rows).to(flat.device))

    def keep_only(self, req_ids: Iterable[str]) -> int:
        """Free the slots of requests not in ``req_ids`` (finished, aborted, preempted);
        returns how many were freed."""
        keep = set(req_ids)
        gone = [r for r in self.slot if r not in keep]
        for rid in gone:
            self._free.append(self.slot.pop(rid))
        return len(gone)

    def rows_kept(self) -> dict[str, int]:
        """Request id -> rows kept (what the memory bound is about)."""
        return {rid: int(self.count[s]) for rid, s in self.slot.items()}


@contextmanager
def _serial_on_cpu(tensor: torch.Tensor) -> Iterator[None]:
    """Run the block's stash copies on one thread when ``tensor`` is on a CPU: rows of a few
    MB copy at memory speed on one thread, while torch splits them over the OpenMP threads,
    whose barrier on cores shared with other processes waited milliseconds for a descheduled
    thread (docs/benchmarks.md, "EAGLE feature stash")."""
    before = torch.get_num_threads()
    serial = tensor.device.type == "cpu" and before > 1
    if serial:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if serial:
            torch.set_num_threads(before)


def ramp(count: np.ndarray) -> np.ndarray:
    """``0 .. count[i] - 1`` for each ``i``, concatenated (int64 [sum(count)])."""
    total = int(count.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
