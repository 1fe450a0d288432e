"""How many CPU threads a draft model's passes run on: measured, not assumed.

A draft model's forward at batch 1 is many small kernels (24 layers of a 0.5B model: ~260
ops reading ~1 GB). Each parallel kernel ends at a barrier, so with two OpenMP threads on
cores shared with other processes, every op waits for the thread that was descheduled: on the
loaded 2-core test machine a 0.5B draft pass took 1214 ms on 2 threads and 131 ms on one
(docs/benchmarks.md, issue 17). On a quiet machine two threads read the weights faster. So the
draft's passes run on whichever thread count measures faster: ``DraftThreads`` tries each
candidate (the engine's count and 1) in turn, keeps a moving average of each one's seconds per
steady pass, uses the faster one, and tries the other again after ``explore_every`` proposals
(the load changes); each try that confirms the choice doubles that interval (up to
``max_explore_every``), a try that changes it resets it: a slow try costs a whole slow pass.
``speculative_config.draft_cpu_threads`` fixes the count instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DraftThreads:
    """The thread count of the draft's next proposal, chosen by measured pass times.

    Args:
        candidates: thread counts to choose between (distinct, >= 1); one entry: fixed.
        explore_every: proposals on the fastest candidate before one runs on another, so a
            stale measurement is renewed (doubled after each try that keeps the choice).
        smoothing: weight of a new measurement in a candidate's moving average.
        max_explore_every: the longest interval between tries.
    """

    def __init__(self, candidates: list[int], explore_every: int = 8,
                 smoothing: float = 0.3, max_explore_every: int = 256) -> None:
        self.candidates = list(dict.fromkeys(candidates))
        self.min_explore_every = self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.smoothing = smoothing
        self.seconds: list[float | None] = [None] * len(self.candidates)
        self.exploring = False  # whether the last pick was a try of a slower candidate
        self._current = self._since_try = 0

    def _best(self) -> int:
        return min(range(len(self.candidates)), key=lambda i: self.seconds[i])

    def pick(self) -> int:
        """The thread count for the next proposal (its index is remembered for ``observe``)."""
        unmeasured = [i for i, s in enumerate(self.seconds) if s is None]
        self.exploring = False
        if unmeasured:
            self._current = unmeasured[0]
        elif len(self.candidates) > 1 and self._since_try >= self.explore_every:
            self._current, self._since_try = (self._best() + 1) % len(self.candidates), 0
            self.exploring = True
        else:
            self._current = self._best()
            self._since_try += 1
        return self.candidates[self._current]

    @property
    def picked_best(self) -> bool:
        """Whether the last pick ran on the candidate now measured fastest (every candidate
        measured): only such passes are the draft's cost (a try, or the first pass on a
        candidate that turns out slower, is not)."""
        return None not in self.seconds and self._current == self._best()

    def seed(self, threads: int, pass_seconds: float) -> None:
        """Record a pass timed on ``threads`` (one of the candidates) before serving as that
        candidate's measurement, so ``pick`` starts on the faster one.

        Raises:
            ValueError: for a thread count that is not a candidate.
        """
        if threads not in self.candidates:
            raise ValueError(f"threads={threads} is not a candidate ({self.candidates})")
        self.seconds[self.candidates.index(threads)] = pass_seconds

    def observe(self, pass_seconds: float) -> None:
        """The seconds of one steady pass of the proposal ``pick`` last chose for (0: none
        ran, nothing learnt)."""
        if pass_seconds <= 0:
            return
        best_before = None if None in self.seconds else self._best()
        old = self.seconds[self._current]
        self.seconds[self._current] = pass_seconds if old is None else \
            old + self.smoothing * (pass_seconds - old)
        if self.exploring:  # a try: kept the choice (back off) or changed it (reset)
            kept = self._best() == best_before
            self.explore_every = min(2 * self.explore_every, self.max_explore_every) \
                if kept else self.min_explore_every

    @contextmanager
    def running(self, threads: int) -> Iterator[None]:
        """Run the block on ``threads`` torch/OpenMP threads (kvflow's native kernels read
        ``torch.get_num_threads``), then restore the engine's count."""
        before = torch.get_num_threads()
        if threads != before:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            if threads != before:
                torch.set_num_threads(before)
