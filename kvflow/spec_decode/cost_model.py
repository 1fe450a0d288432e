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
verification would cost more than it saves, and also whenever the best prefix beats it by less
than ``MIN_GAIN`` (5%): near break-even the noisy measurements would otherwise turn speculation
on and off from step to step, and each time on costs more than predicted (the draft model
recomputes the K/V it skipped while off).

A draft model's cost counts from the first step: the engine times draft passes at start-up
(``draft_timing.time_draft_passes``: 1, 2, 4, ... requests, about a second) and observes them
in the draft's ``StepTimes``, so the cost of a pass over 32 requests is measured (or extrapolated
from the largest passes timed), not guessed: a draft's weight bytes said 0.12 s for an INT8
draft's pass at 32 requests where it took 1.28 s (its kernel is compute-bound there while the
target's bf16 GEMMs run on AMX; docs/benchmarks.md, issue 17). Without any measurement (an
engine that did not time its draft) a pass costs ``seed_ratio`` times a target step of as many
tokens, never nothing. A request whose draft K/V lags its context (new, or not drafted for a
while) is charged the draft tokens its catch-up computes, spread over its remaining steps, at
the draft's marginal cost per token of a pass.
"""

from __future__ import annotations

import numpy as np

# Speculate only when the predicted tokens per second beat no speculation by this fraction.
MIN_GAIN = 0.05

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

    A bin not observed for ``stale_after`` observations is stale: ``is_measured`` says no (so
    the caller measures it again) and ``predict`` leaves it out while any bin is fresh. Its
    time was taken under another load, and the steps that would renew it may never run: on
    the shared 2-core machine the target's steps of 2-4 tokens, measured at 0.7-1.1 s in a
    minute when other processes took the cores, against 0.28 s for the 1-token step renewed
    since, kept adaptive lengths at zero for good (docs/benchmarks.md, issue 17, session 4).
    Left out, the fresh bins' line predicts them again, drafts run and renew them.

    Args:
        smoothing: weight of a new observation in its bin's averages.
        stale_after: observations after which an unobserved bin is stale.
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
        """Predicted seconds for each count (float64, shape of ``counts``) from the fresh bins
        (all measured bins when none is fresh), or None before any measurement."""
        measured = np.flatnonzero(self.last_seen >= 0)
        if not len(measured):
            return None
        fresh = measured[self.num_observations - self.last_seen[measured] <= self.stale_after]
        measured = fresh if len(fresh) else measured
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


def draft_pass_seconds(rows: np.ndarray, target_times: StepTimes,
                       draft_times: StepTimes | None, seed_ratio: float) -> np.ndarray:
    """Predicted seconds of one draft-model pass over ``rows`` tokens (one per drafting
    request; float64, shape of ``rows``): the measured passes (``draft_times``) once there are
    any, before that ``seed_ratio`` times a target step of as many tokens; zeros without a
    draft model (n-gram) or without any measurement at all."""
    if draft_times is None:
        return np.zeros(np.shape(rows))
    measured = draft_times.predict(rows)
    if measured is not None:
        return measured
    target = target_times.predict(rows)
    return np.zeros(np.shape(rows)) if target is None else seed_ratio * target


def choose_draft_lengths(alpha: np.ndarray, available: np.ndarray, num_base_tokens: int,
                         target_times: StepTimes, draft_times: StepTimes | None = None, *,
                         seed_ratio: float = 1.0, catch_up_tokens: np.ndarray | None = None,
                         min_gain: float = MIN_GAIN) -> np.ndarray:
    """Draft tokens per request (int64 [R]) maximizing expected tokens per second.

    Args:
        alpha: float64 [R], each request's per-token acceptance probability.
        available: int64 [R], most drafts each request can take this step (the n-gram match
            length, or K capped by max_tokens / max_model_len).
        num_base_tokens: tokens the step computes without drafts (every request's catch-up).
        target_times: step seconds by tokens per step (the target's forward and sampling).
        draft_times: seconds per draft-model pass by requests in the pass; None when drafts
            cost nothing measurable (n-gram).
        seed_ratio: a draft pass's cost over a target step's of as many tokens while no
            draft pass is measured (``draft_pass_seconds``), so that an unmeasured draft is
            never taken for free.
        catch_up_tokens: float64 [R], draft-model tokens a request's first draft this step
            makes the draft compute beyond its steady pass (its draft K/V lags its context),
            already spread over the steps it is expected to keep drafting; charged as a draft
            pass over that many more tokens: ``draft(rows + extra) - draft(rows)``.
        min_gain: speculate only when the predicted tokens per second exceed those without
            drafts by this fraction: the measurements are noisy, and near break-even a draft
            that pays on paper costs more than it saves in practice.

    Returns:
        Zeros when speculation does not pay by ``min_gain`` (or nothing is measured yet).
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
        rows = np.cumsum(pos == 0).astype(np.float64)  # ... over the requests drafting
        one_pass = draft_pass_seconds(rows, target_times, draft_times, seed_ratio)
        seconds[1:] += passes * one_pass
        if catch_up_tokens is not None:  # the first (mirror) pass computes them too
            extra = np.cumsum(np.where(pos == 0, catch_up_tokens[req], 0.0))
            longer = draft_pass_seconds(rows + extra, target_times, draft_times, seed_ratio)
            seconds[1:] += np.maximum(longer - one_pass, 0.0)
    tokens = num_reqs + np.concatenate([[0.0], np.cumsum(gains.ravel()[order])])
    rate = tokens / np.maximum(seconds, 1e-9)
    best = int(np.argmax(rate))
    if rate[best] < (1.0 + min_gain) * rate[0]:
        return lengths
    np.add.at(lengths, req[:best], 1)
    return lengths
