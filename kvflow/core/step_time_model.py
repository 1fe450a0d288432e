"""An online model of how long one engine step takes, fitted from measured steps.

The model (linear in four features of the step; every coefficient >= 0):

    t_step = c0 + c1 * prefill_tokens + c2 * decode_requests + c3 * context_tokens

* ``prefill_tokens``: tokens of the requests that compute more than one token this step
  (prompt chunks, recomputation after preemption): one GEMM row each in every layer;
* ``decode_requests``: requests computing exactly one token (a decode): a GEMM row plus an
  LM-head row and a sampler row each;
* ``context_tokens``: the keys the step's query tokens attend to, summed over query tokens (a
  decode at context ``c`` reads ``c + 1`` keys; a chunk of ``n`` tokens after ``c`` cached ones
  reads ``n * c + n (n + 1) / 2``): the attention work, which grows with context length;
* ``c0``: the fixed cost of a step (launch, host work, weights read once per step).

This is the decomposition that SLO-aware schedulers fit or profile: DistServe (Zhong et al.,
OSDI 2024, sec. 3.1 and appendix A: step latency linear in the batch's token count plus a term
quadratic in prompt length for attention) and Sarathi-Serve (Agrawal et al., OSDI 2024, sec.
4.3: the per-step token budget chosen from the time-between-tokens SLO by profiling step time
against tokens); Vidur (Agrawal et al., MLSys 2024) predicts the same per-operator terms. kvflow
profiles nothing ahead: it fits ordinary least squares over the last ``window`` measured steps
(``numpy.linalg.lstsq`` on columns scaled to unit maximum; a coefficient that comes out negative
is fixed at 0 and the rest refitted, the active-set step of Lawson & Hanson's NNLS), refitting
every ``refit_every`` steps, so it follows the machine's load and the model's real costs.

The prediction error of every step predicted before it ran (absolute, and relative to the
measured time) is kept over the last ``window`` steps for /metrics.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

_NUM_FEATURES = 4


@dataclass(frozen=True)
class StepFeatures:
    """What one step computes (see the module docstring for each term).

    Attributes:
        prefill_tokens: tokens of requests computing more than one token.
        decode_requests: requests computing exactly one token.
        context_tokens: keys attended, summed over the step's query tokens.
    """

    prefill_tokens: int = 0
    decode_requests: int = 0
    context_tokens: int = 0

    def row(self) -> tuple[float, float, float, float]:
        """The design-matrix row: (1, prefill tokens, decode requests, context tokens)."""
        return (1.0, float(self.prefill_tokens), float(self.decode_requests),
                float(self.context_tokens))


def chunk_context_tokens(num_computed: int, num_new: int) -> int:
    """Keys attended by a chunk of ``num_new`` query tokens after ``num_computed`` cached
    tokens (causal: query ``j`` sees ``num_computed + j + 1`` keys)."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


class StepTimeModel:
    """Least-squares fit of step time (seconds) on ``StepFeatures`` over a recent window.

    Args:
        window: measured steps kept for the fit (and for the error statistics).
        min_steps: steps needed before the model predicts anything.
        refit_every: observations between two fits.
    """

    def __init__(self, window: int = 512, min_steps: int = 16, refit_every: int = 16) -> None:
        self.window, self.min_steps, self.refit_every = window, min_steps, refit_every
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coef: np.ndarray | None = None  # seconds per unit of each feature
        self._abs_errors: deque[float] = deque(maxlen=window)
        self._rel_errors: deque[float] = deque(maxlen=window)
        self.num_observed = 0
        self.num_predicted = 0

    @property
    def is_ready(self) -> bool:
        """Whether enough steps were measured for predictions."""
        return self.coef is not None

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted step time in seconds, or None before the first fit."""
        if self.coef is None:
            return None
        c = self.coef
        return float(c[0] + c[1] * features.prefill_tokens + c[2] * features.decode_requests
                     + c[3] * features.context_tokens)

    def predict_raw(self, prefill_tokens: float, decode_requests: float,
                    context_tokens: float) -> float:
        """``predict`` without building a StepFeatures (the planner's inner loop); the model
        must be ready."""
        c = self.coef
        return float(c[0] + c[1] * prefill_tokens + c[2] * decode_requests
                     + c[3] * context_tokens)

    def observe(self, features: StepFeatures, seconds: float,
                predicted: float | None = None) -> None:
        """Record one measured step (and the error of its prediction, if one was made);
        refit when due.

        Raises:
            ValueError: for a negative or non-finite duration.
        """
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"step time {seconds!r} must be a finite number of seconds >= 0")
        self._rows.append(features.row())
        self._times.append(seconds)
        self.num_observed += 1
        self._since_fit += 1
        if predicted is not None:
            self.num_predicted += 1
            self._abs_errors.append(abs(predicted - seconds))
            self._rel_errors.append(abs(predicted - seconds) / max(seconds, 1e-6))
        if len(self._rows) >= self.min_steps and \
                (self.coef is None or self._since_fit >= self.refit_every):
            self.fit()

    def fit(self) -> None:
        """Refit the coefficients on the window (no-op with fewer than ``min_steps``)."""
        if len(self._rows) < self.min_steps:
            return
        x = np.asarray(self._rows, dtype=np.float64)
        y = np.asarray(self._times, dtype=np.float64)
        self.coef = nonnegative_least_squares(x, y)
        self._since_fit = 0

    @property
    def mean_abs_error(self) -> float:
        """Mean |predicted - measured| step time over the window, seconds (0 before any)."""
        return float(np.mean(self._abs_errors)) if self._abs_errors else 0.0

    @property
    def mean_rel_error(self) -> float:
        """Mean |predicted - measured| / measured over the window (0 before any)."""
        return float(np.mean(self._rel_errors)) if self._rel_errors else 0.0


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares ``coef >= 0`` for ``x @ coef ~ y``: ordinary least squares on columns
    scaled to unit maximum, dropping (fixing at 0) the most negative coefficient and refitting
    until none is negative (an active-set approximation of NNLS, Lawson & Hanson 1974, ch. 23;
    exact when at most one constraint is active).

    Args:
        x: float64 [steps, features].
        y: float64 [steps], seconds.

    Returns:
        float64 [features].
    """
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale
