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
(the normal equations, kept as running sums and Jacobi-scaled; a coefficient that comes out
negative is fixed at 0 and the rest refitted, the active-set step of Lawson & Hanson's NNLS),
refitting every ``refit_every`` steps, so it follows the machine's load and the model's real
costs.

The window's fit lags a change in the machine's speed (other processes taking the cores) by up
to ``window`` steps, so predictions are the fit times a *bias*: the ratio measured / fitted
prediction, exponentially smoothed over about ``BIAS_STEPS`` steps (simple exponential
smoothing, Brown 1956; the measurement feedback of a model-predictive controller). On a steady
machine the bias stays near 1; when the machine slows down by 2x it follows within a few
dozen steps, long before the window's fit does.

The prediction error of every step predicted before it ran (absolute, and relative to the
measured time) is kept over the last ``window`` steps for /metrics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

BIAS_STEPS = 16  # the bias follows measured / fitted step time over about this many steps
MAX_BIAS = 8.0  # one step's ratio counts at most this far from 1 (either way)


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


# The window's sums the normal equations need: count (1*1), each feature (1*x), the products
# of features (x*x'), and each feature with the step time (x*y). "1" is the constant column,
# "p" prefill tokens, "d" decode requests, "c" context tokens, "y" the measured seconds.
_TERMS = ("11", "1p", "1d", "1c", "pp", "pd", "pc", "dd", "dc", "cc", "1y", "py", "dy", "cy")


def _term(a: str, b: str) -> str:
    """The name in ``_TERMS`` of the product of columns ``a`` and ``b``."""
    order = "1pdcy"
    return a + b if order.index(a) <= order.index(b) else b + a


_COLUMNS = "1pdc"
_XTX_INDEX = np.array([[_TERMS.index(_term(a, b)) for b in _COLUMNS] for a in _COLUMNS])
_XTY_INDEX = np.array([_TERMS.index(_term(a, "y")) for a in _COLUMNS])
_XTX_INDEX.flags.writeable = _XTY_INDEX.flags.writeable = False  # constants


def _sum_terms(f: StepFeatures, y: float) -> tuple[float, ...]:
    """One step's contribution to each of ``_TERMS`` (plain floats: this runs every step)."""
    p, d, c = float(f.prefill_tokens), float(f.decode_requests), float(f.context_tokens)
    return (1.0, p, d, c, p * p, p * d, p * c, d * d, d * c, c * c, y, p * y, d * y, c * y)


class StepTimeModel:
    """Least-squares fit of step time (seconds) on ``StepFeatures`` over a recent window.

    The fit runs on the normal equations, whose sums (``X^T X``, ``X^T y``) are updated as a
    step enters and leaves the window (recomputed from the window every ``window`` steps so
    rounding cannot drift): an observation costs a few microseconds and a refit solves a 4x4
    system, which keeps the model cheap enough to learn on every engine step.

    Args:
        window: measured steps kept for the fit (and for the error statistics).
        min_steps: steps needed before the model predicts anything.
        refit_every: observations between two fits.
        settle_steps: steps measured before ``is_settled`` (the first fits, from a few steps
            of similar shape, can misplace the fixed cost by tens of percent).
    """

    def __init__(self, window: int = 512, min_steps: int = 16, refit_every: int = 16,
                 settle_steps: int = 48) -> None:
        self.window, self.min_steps, self.refit_every = window, min_steps, refit_every
        self.settle_steps = settle_steps
        self._steps: deque[tuple[float, ...]] = deque()  # each step's ``_sum_terms``
        self._sums = [0.0] * len(_TERMS)  # their sums over the window
        self._since_fit = self._since_resum = 0
        self.coef: np.ndarray | None = None  # seconds per unit of each feature
        self._c: tuple[float, ...] = ()  # coef as Python floats (fast predictions)
        self._errors: deque[tuple[float, float]] = deque()  # (abs, rel) over the window
        self._sum_abs = self._sum_rel = 0.0
        self.num_observed = 0
        self.num_predicted = 0
        self.bias = 1.0  # recent measured / fitted step time (see the module docstring)

    @property
    def is_ready(self) -> bool:
        """Whether enough steps were measured for predictions."""
        return self.coef is not None

    @property
    def is_settled(self) -> bool:
        """Whether ``settle_steps`` steps were measured: enough to trust the fit's
        extrapolation (e.g. to a step of one decode) for decisions a wrong answer makes
        costly."""
        return self.coef is not None and self.num_observed >= self.settle_steps

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted step time in seconds (the fit times ``bias``), or None before the first
        fit."""
        if self.coef is None:
            return None
        return self.predict_raw(features.prefill_tokens, features.decode_requests,
                                features.context_tokens)

    def predict_raw(self, prefill_tokens: float, decode_requests: float,
                    context_tokens: float) -> float:
        """``predict`` without building a StepFeatures (the planner's inner loop); the model
        must be ready."""
        return self.bias * self.predict_fit(prefill_tokens, decode_requests, context_tokens)

    def predict_fit(self, prefill_tokens: float, decode_requests: float,
                    context_tokens: float) -> float:
        """The window's fit alone, without the recent ``bias`` (seconds): the machine's speed
        over the whole window, for decisions a transient slowdown must not flip."""
        c = self._c
        return c[0] + c[1] * prefill_tokens + c[2] * decode_requests + c[3] * context_tokens

    def observe(self, features: StepFeatures, seconds: float,
                predicted: float | None = None) -> None:
        """Record one measured step (and the error of its prediction, if one was made);
        refit when due.

        Raises:
            ValueError: for a negative or non-finite duration.
        """
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"step time {seconds!r} must be a finite number of seconds >= 0")
        terms = _sum_terms(features, seconds)
        if len(self._steps) == self.window:
            old = self._steps.popleft()
            self._sums = [s + t - o for s, t, o in zip(self._sums, terms, old)]
        else:
            self._sums = [s + t for s, t in zip(self._sums, terms)]
        self._steps.append(terms)
        self.num_observed += 1
        self._since_fit += 1
        self._since_resum += 1
        if self._since_resum >= self.window:
            self._resum()
        if predicted is not None:
            self._record_error(abs(predicted - seconds), seconds)
            self._update_bias(predicted, seconds)
        if len(self._steps) >= self.min_steps and \
                (self.coef is None or self._since_fit >= self.refit_every):
            self.fit()

    def _resum(self) -> None:
        """Recompute the window's sums exactly (bounds the rounding of add/remove)."""
        self._sums = [math.fsum(col) for col in zip(*self._steps)]
        self._since_resum = 0

    def _update_bias(self, predicted: float, seconds: float) -> None:
        """Smooth in one step's measured / fitted ratio (``predicted`` included the bias of
        the time; each ratio is clipped to [1/MAX_BIAS, MAX_BIAS] so one stall cannot swing
        the bias)."""
        fitted = predicted / self.bias
        if fitted <= 0:
            return
        ratio = min(max(seconds / fitted, 1 / MAX_BIAS), MAX_BIAS)
        self.bias += (ratio - self.bias) / BIAS_STEPS

    def _record_error(self, abs_error: float, seconds: float) -> None:
        rel = abs_error / max(seconds, 1e-6)
        if len(self._errors) == self.window:
            old_abs, old_rel = self._errors.popleft()
            self._sum_abs -= old_abs
            self._sum_rel -= old_rel
        self._errors.append((abs_error, rel))
        self._sum_abs += abs_error
        self._sum_rel += rel
        self.num_predicted += 1

    def fit(self) -> None:
        """Refit the coefficients on the window (no-op with fewer than ``min_steps``)."""
        if len(self._steps) < self.min_steps:
            return
        sums = np.asarray(self._sums, dtype=np.float64)
        self.coef = nonnegative_normal_equations(sums[_XTX_INDEX], sums[_XTY_INDEX])
        self._c = tuple(float(c) for c in self.coef)
        self._since_fit = 0

    @property
    def mean_abs_error(self) -> float:
        """Mean |predicted - measured| step time over the window, seconds (0 before any)."""
        return max(0.0, self._sum_abs / len(self._errors)) if self._errors else 0.0

    @property
    def mean_rel_error(self) -> float:
        """Mean |predicted - measured| / measured over the window (0 before any)."""
        return max(0.0, self._sum_rel / len(self._errors)) if self._errors else 0.0


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares ``coef >= 0`` for ``x @ coef ~ y`` (see ``nonnegative_normal_equations``).

    Args:
        x: float64 [steps, features].
        y: float64 [steps], seconds.

    Returns:
        float64 [features].
    """
    return nonnegative_normal_equations(x.T @ x, x.T @ y)


def nonnegative_normal_equations(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    """Least-squares ``coef >= 0`` from the normal equations ``(X^T X) coef = X^T y``:
    solved on the Jacobi-scaled system (each column scaled to unit norm), dropping (fixing at
    0) the most negative coefficient and resolving until none is negative (an active-set
    approximation of NNLS, Lawson & Hanson 1974, ch. 23; exact when at most one constraint is
    active). A column that is all zero gets 0.

    Args:
        xtx: float64 [features, features], X^T X.
        xty: float64 [features], X^T y.

    Returns:
        float64 [features].
    """
    norms = np.sqrt(np.clip(np.diag(xtx), 0.0, None))
    active = [i for i in range(len(xty)) if norms[i] > 0]
    scale = np.where(norms > 0, norms, 1.0)
    gram, rhs = xtx / np.outer(scale, scale), xty / scale
    coef = np.zeros(len(xty))
    while active:
        sol, *_ = np.linalg.lstsq(gram[np.ix_(active, active)], rhs[active], rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale
