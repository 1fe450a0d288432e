"""Adaptive speculation length: measured step costs and the choice of draft lengths.

Speculation pays when the tokens it adds to a step cost less time than the extra tokens it
produces. Both sides are measured, not assumed:

* ``StepTimes`` keeps the engine's measured step time as a function of a count (tokens per
  step for the target; requests per pass for a draft model): a moving average per bin of
  log-spaced counts, interpolated between measured bins. At batch 1 on a CPU a step of 5 tokens
  costs about what a step of 1 does (the weights are read once either way), so drafts are
  nearly free; at batch 32 the step is compute-bound and every draft token costs its share.
* Each request's acceptance probability ``alpha`` (per draft token, estimated from its own
  record, shrunk toward the engine-wide rate) gives the expected tokens of ``k`` drafts:
  draft ``i`` (1-based) is used only if drafts ``1..i`` are all accepted, so it adds
  ``alpha ** i`` expected tokens.

``choose_draft_lengths`` then picks, for the whole batch, the draft lengths that maximize
expected tokens per second: every (request, draft index) candidate sorted by its expected
tokens, and the best prefix of that order (each request's gains decrease with the index, so a
prefix is a set of per-request lengths). An empty prefix - no speculation - wins whenever
verification would cost more than it saves.
"""

from __future__ import annotations

import numpy as np

# Bin edges (counts): 1, 2, 3, 4, 6, 8, 12, 16, ... doubling pairs up to ~1M.
_BINS = np.unique(np.concatenate([[1, 2, 3], (2 ** np.arange(2, 21)),
                                  (3 * 2 ** np.arange(1, 20))])).astype(np.float64)


class StepTimes:
    """Seconds per step as a function of a count, from measurements.

    Observations fall into bins of log-spaced counts; each bin keeps the exponential moving
    average (weight ``smoothing``) of its observed counts and seconds. ``predict`` interpolates
    linearly (in counts) between measured bins, holds the first measured value below them (a
    smaller step never costs more), and extrapolates above them along the last two measured
    bins' slope (flat with one bin).

    Args:
        smoothing: weight of a new observation in its bin's averages.
        stale_after: a bin not observed for this many observations counts as unmeasured
            (``is_measured``), so the caller measures it again (the machine's load changes).
    """

    def __init__(self, smoothing: float = 0.25, stale_after: int = 256) -> None:
        self.smoothing = smoothing
        self.stale_after = stale_after
        self.counts = np.zeros(len(_BINS))
        self.seconds = np.zeros(len(_BINS))
        self.last_seen = np.full(len(_BINS), -10**9, np.int64)
        self.num_observations = 0

    @staticmethod
    def _bin(count: float) -> int:
        return int(np.abs(np.log(_BINS) - np.log(max(count, 1.0))).argmin())

    def observe(self, count: int, seconds: float) -> None:
        """Record one measured step of ``count`` (tokens or requests) taking ``seconds``."""
        b = self._bin(count)
        w = 1.0 if self.last_seen[b] < 0 else self.smoothing
        self.counts[b] += w * (count - self.counts[b])
        self.seconds[b] += w * (seconds - self.seconds[b])
        self.last_seen[b] = self.num_observations
        self.num_observations += 1

    def is_measured(self, count: int) -> bool:
        """Whether ``count``'s bin has a recent measurement."""
        return self.num_observations - self.last_seen[self._bin(count)] <= self.stale_after

    def predict(self, counts: np.ndarray) -> np.ndarray | None:
        """Predicted seconds for each count (float64, shape of ``counts``), or None before
        any measurement."""
        measured = np.flatnonzero(self.last_seen >= 0)
        if not len(measured):
            return None
        x, y = self.counts[measured], self.seconds[measured]
        c = np.asarray(counts, np.float64)
        out = np.interp(c, x, y)  # constant outside the measured range
        if len(measured) >= 2:  # above: the last segment's slope
            slope = max(0.0, (y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9))
            above = c > x[-1]
            out[above] = y[-1] + slope * (c[above] - x[-1])
        return out


def acceptance_estimate(accepted: np.ndarray, rejections: np.ndarray,
                        prior: float, prior_weight: float = 2.0) -> np.ndarray:
    """Per-token acceptance probability per request (float64 [R]).

    A step's drafts are examined until the first rejection, so with per-token probability
    ``alpha`` the accepted count before each rejection is geometric, and the maximum-likelihood
    estimate is ``accepted / (accepted + rejections)``; ``prior`` (the engine-wide estimate)
    counts as ``prior_weight`` observations, so a new request starts there.
    """
    return (accepted + prior_weight * prior) / (accepted + rejections + prior_weight)


def choose_draft_lengths(alpha: np.ndarray, available: np.ndarray, num_base_tokens: int,
                         target_times: StepTimes, draft_times: StepTimes | None = None
                         ) -> np.ndarray:
    """Draft tokens per request (int64 [R]) maximizing expected tokens per second.

    Args:
        alpha: float64 [R], each request's per-token acceptance probability.
        available: int64 [R], most drafts each request can take this step (the n-gram match
            length, or K capped by max_tokens / max_model_len).
        num_base_tokens: tokens the step computes without drafts (every request's catch-up).
        target_times: step seconds by tokens per step (the target's forward and sampling).
        draft_times: seconds per draft-model pass by requests in the pass; None when drafts
            cost nothing measurable (n-gram).

    Returns:
        Zeros when speculation does not pay (or nothing is measured yet).
    """
    num_reqs, k_max = len(alpha), int(available.max(initial=0))
    lengths = np.zeros(num_reqs, np.int64)
    if k_max == 0:
        return lengths
    index = np.arange(1, k_max + 1)
    gains = np.where(index <= available[:, None], alpha[:, None] ** index, -1.0)
    order = np.argsort(-gains, axis=None, kind="stable")
    order = order[gains.ravel()[order] > 0]
    if not len(order):
        return lengths
    req, pos = np.divmod(order, k_max)
    num_drafts = np.arange(1, len(order) + 1)
    seconds = target_times.predict(np.concatenate([[num_base_tokens],
                                                   num_base_tokens + num_drafts]))
    if seconds is None:
        return lengths
    if draft_times is not None:
        passes = np.maximum.accumulate(pos + 1)  # a draft model runs max(k) passes ...
        rows = np.cumsum(pos == 0)  # ... over the requests drafting
        per_pass = draft_times.predict(rows)
        seconds[1:] += passes * (per_pass if per_pass is not None else 0.0)
    tokens = num_reqs + np.concatenate([[0.0], np.cumsum(gains.ravel()[order])])
    best = int(np.argmax(tokens / np.maximum(seconds, 1e-9)))
    np.add.at(lengths, req[:best], 1)
    return lengths
