"""Service-level planning: each step's prefill budget and admissions from TTFT/TPOT targets.

The scheduler's rule is unchanged (every request catches ``num_computed_tokens`` up toward its
tokens within a budget); this module only sizes the budget. It keeps a ``StepTimeModel``
(``core/step_time_model.py``) fitted from measured steps and, each step:

* **TPOT**: a running request with a time-per-output-token target ``tpot`` whose first token
  came at ``f`` and that has produced ``k`` tokens since is on schedule if its next token comes
  by ``f + (k + 1) * tpot`` (then its mean TPOT, the SLO's definition, stays under ``tpot``
  whatever comes later). The step may last until the earliest such deadline among the running
  requests (``PLAN_MARGIN`` of the way there, for the model's error; never more than
  ``MAX_STEP_TPOTS`` targets), so a request that ran ahead of its target banks slack that a
  larger prefill step may spend; a request behind its target pays the debt back over its next
  ``CATCH_UP_TOKENS`` tokens (``step_allowance``) instead of stopping all prefill until it has
  caught up. Decodes are always scheduled; the prefill chunks get the tokens the model
  predicts fit in what is left (``StepBudget``).
* **Lost causes do not shrink the batch**: a request that could not end on its target even
  decoding alone (``is_lost``), and a target below one decode step (``is_unreachable``: no
  batch can meet it), no longer limit the step or the admissions: starving the batch would
  help no one, so the step falls back to the fixed budget's throughput. Both use the window's
  fit without the recent bias (``StepTimeModel.predict_fit``), once the model has settled, so
  a transient slowdown does not give requests up.
* **Admissions**: a waiting request is admitted only if a step of decodes alone, with it and
  every running request decoding, is predicted under ``GATE_HEADROOM`` of the smallest TPOT
  target involved, leaving the rest of each step for prefill (so running requests keep their
  TPOT as the batch grows).
* **Feedback**: every prediction is the least-squares fit times the recent ratio of measured
  to fitted step time (``StepTimeModel.bias``): when other processes slow the machine down,
  the plan follows the measured steps within a few dozen steps instead of the fit's window.
* **TTFT**: a waiting request that has not produced a token by ``arrival + ttft`` is *late*;
  the scheduler admits requests that can still meet their target first and late ones with
  what is left. With admission control the core refuses, at arrival, a request whose
  predicted time to first token (``ttft_outlook``) exceeds its target, and says when to retry
  (above capacity this is where goodput comes from: a queue that grows makes every request
  miss its TTFT).

**Cold steps**: the engine's first ``COLD_STEPS`` steps are not fed to the model. They run
cold (fresh activation buffers paged in, first calls of the kernels): on SmolLM2 on the CPU the
first three whole-prompt prefills of a fresh engine took 1.6-1.9x the time per token of the
same prefills later (``benchmarks/slo_record_steps.py``, two recordings). They are also the
only whole prompts in a chat workload's window (later prompts hit the prefix cache of their
system prompt), so the fit's forecast of a whole prompt rested on them: a warm idle server
forecast a lone 550-token prompt at 1.5-2x its real TTFT and admission control refused
requests it could serve.

Before the model has measured ``StepTimeModel.min_steps`` steps the fixed budget
(``max_num_batched_tokens``) applies. Without targets nothing changes but the model still
learns (its error is on /metrics).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvflow.config import SchedulerConfig
from kvflow.core.step_time_model import StepFeatures, StepTimeModel, chunk_context_tokens
from kvflow.request import Request
from kvflow.sched_output import SchedulerOutput

# A scheduled step waiting for its duration: its features and the model's prediction for them.
NotedStep = tuple[StepFeatures, float | None]

MAX_STEP_TPOTS = 3.0  # a step never plans to last longer than this many TPOT targets
GATE_HEADROOM = 0.8  # admissions keep a decode-only step under this share of the TPOT target
PLAN_MARGIN = 0.9  # a step is planned to end this share of the way to the next deadline
CATCH_UP_TOKENS = 32  # a request behind its TPOT target pays its debt back over these tokens
COLD_STEPS = 4  # a fresh engine's first steps run cold: the step-time model does not learn them


@dataclass
class RequestSLO:
    """One request's targets (seconds; None: none) and its token timeline."""

    ttft_s: float | None
    tpot_s: float | None
    arrival_time: float
    first_token_time: float | None = None
    num_after_first: int = 0  # tokens produced after the first
    max_tokens: int | None = None  # the request's output cap (None: unknown)


class StepBudget:
    """One step's prefill allowance under the TPOT deadlines of the running requests.

    Args:
        model: the fitted step-time model.
        allowed_s: how long the step may take (seconds; inf: no TPOT bound).
        num_decodes / decode_context: running requests computing one token, and the keys
            they attend.
        num_running / running_context: all running requests and their tokens (each will
            decode): the admission gate's starting point.
        tpot_s: the smallest TPOT target among the running requests (inf: none).
    """

    def __init__(self, model: StepTimeModel, allowed_s: float, num_decodes: int,
                 decode_context: int, num_running: int, running_context: int,
                 tpot_s: float) -> None:
        self.model, self.allowed_s = model, allowed_s
        self.num_decodes = num_decodes
        self.prefill_tokens = 0
        self.context_tokens = decode_context
        self.num_future_decodes, self.future_context = num_running, running_context
        self.tpot_s = tpot_s

    def take_prefill(self, num_computed: int, wanted: int) -> int:
        """The largest chunk (<= ``wanted`` tokens, after ``num_computed`` cached ones) that
        keeps the step's predicted time within ``allowed_s``; counted into the step. The
        first chunk of a step without decodes is never cut (no decode to protect; a step
        must make progress)."""
        if self.allowed_s == math.inf or self._fits(num_computed, wanted) or \
                not (self.num_decodes or self.prefill_tokens):
            n = wanted
        else:
            lo, hi = 0, wanted  # _fits(lo) holds or lo == 0; _fits(hi) fails
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._fits(num_computed, mid) else (lo, mid)
            n = lo
        self.prefill_tokens += n
        self.context_tokens += chunk_context_tokens(num_computed, n)
        return n

    def _fits(self, num_computed: int, n: int) -> bool:
        return self.model.predict_raw(
            self.prefill_tokens + n, self.num_decodes,
            self.context_tokens + chunk_context_tokens(num_computed, n)) <= self.allowed_s

    def may_admit(self, request: Request, tpot_s: float | None) -> bool:
        """Whether ``request`` (TPOT target ``tpot_s``, None: none) may join the running
        batch: a decode-only step with it and every running request must be predicted under
        ``GATE_HEADROOM`` of the smallest TPOT target (into an empty batch it always may).
        Counted in when admitted."""
        tpot = min(self.tpot_s, tpot_s or math.inf)
        # alone, it is always admitted; a target no batch can meet does not limit the batch
        if tpot < math.inf and self.num_future_decodes and \
                not is_unreachable(self.model, tpot, request.num_tokens):
            step = self.model.predict_raw(0, self.num_future_decodes + 1,
                                          self.future_context + request.num_tokens)
            if step > GATE_HEADROOM * tpot:
                return False
        self.num_future_decodes += 1
        self.future_context += request.num_tokens
        return True


class WarmupBudget(StepBudget):
    """Before the step-time model is ready: any prefill, at most one admission per step."""

    def __init__(self) -> None:
        self.admitted = False

    def take_prefill(self, num_computed: int, wanted: int) -> int:
        return wanted

    def may_admit(self, request: Request, tpot_s: float | None) -> bool:
        admitted, self.admitted = self.admitted, True
        return not admitted


class SLOPlanner:
    """Per-request SLO state, the step-time model and the per-step budget.

    Args:
        config: the scheduler config (server-wide targets, token budget, admission control).
        model: the step-time model (default: a fresh one).
    """

    def __init__(self, config: SchedulerConfig, model: StepTimeModel | None = None) -> None:
        self.config = config
        self.model = model or StepTimeModel()
        self.slos: dict[str, RequestSLO] = {}
        self._num_tpot = 0  # requests with a TPOT target
        self._step: NotedStep | None = None  # the last step scheduled, not yet timed
        self._num_timed = 0  # steps whose time was reported (the first COLD_STEPS unused)

    # ---- requests ----------------------------------------------------------------------------
    def targets_of(self, request: Request) -> RequestSLO:
        """A request's targets: its own, else the engine's (seconds; None: none)."""
        params, cfg = request.sampling_params, self.config
        ttft = params.target_ttft_ms or cfg.target_ttft_ms
        tpot = params.target_tpot_ms or cfg.target_tpot_ms
        return RequestSLO(None if ttft is None else ttft / 1e3,
                          None if tpot is None else tpot / 1e3, request.arrival_time,
                          max_tokens=params.max_tokens)

    def add(self, request: Request) -> None:
        """Record a request's targets; requests without any are not tracked."""
        slo = self.targets_of(request)
        if slo.ttft_s is None and slo.tpot_s is None:
            return
        self.slos[request.request_id] = slo
        self._num_tpot += slo.tpot_s is not None

    def remove(self, request_id: str) -> None:
        """Forget a finished request."""
        slo = self.slos.pop(request_id, None)
        if slo is not None and slo.tpot_s is not None:
            self._num_tpot -= 1

    def on_tokens(self, request_id: str, num_new: int, now: float) -> None:
        """``num_new`` tokens were produced for the request at ``now``."""
        slo = self.slos.get(request_id)
        if slo is None or not num_new:
            return
        if slo.first_token_time is None:
            slo.first_token_time = now
            num_new -= 1
        slo.num_after_first += num_new

    def is_late(self, request: Request, now: float) -> bool:
        """A request without a token yet whose TTFT target has passed."""
        slo = self.slos.get(request.request_id)
        return slo is not None and slo.ttft_s is not None and slo.first_token_time is None \
            and now > slo.arrival_time + slo.ttft_s

    def tpot_of(self, request: Request) -> float | None:
        slo = self.slos.get(request.request_id)
        return None if slo is None else slo.tpot_s

    # ---- one step ----------------------------------------------------------------------------
    def step_budget(self, running: Iterable[Request], now: float) -> StepBudget | None:
        """This step's budget, or None when no TPOT target is in play (then the fixed token
        budget alone applies). While the model is still learning, a ``WarmupBudget``: one
        admission per step (a slow start that also gives the fit steps of varied sizes)."""
        if not self._num_tpot:
            return None
        if not self.model.is_ready:
            return WarmupBudget()
        return plan_step(self.model, running, self.slos, now)

    def note_step(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Remember the step just scheduled (its features and predicted time) until its
        duration is measured (``record_step_time``)."""
        if out.is_empty:
            self._step = None
            return
        features = step_features(out, requests)
        self._step = (features, self.model.predict(features))

    def record_step_time(self, seconds: float) -> None:
        """The last scheduled step took ``seconds``: one more observation for the model
        (except the engine's first ``COLD_STEPS`` steps, see the module docstring)."""
        step, self._step = self._step, None
        self.record_noted_step_time(step, seconds)

    def take_noted_step(self) -> NotedStep | None:
        """The step just noted (``note_step``; None for an empty one), handed to a caller
        that keeps several steps in flight and times each itself (pipeline parallelism's
        micro-batches); it reports it with :meth:`record_noted_step_time`."""
        step, self._step = self._step, None
        return step

    def record_noted_step_time(self, step: NotedStep | None, seconds: float) -> None:
        """Step ``step`` (from :meth:`take_noted_step`) took ``seconds``: as
        :meth:`record_step_time`; nothing for None."""
        if step is not None:
            features, predicted = step
            self._num_timed += 1
            if self._num_timed > COLD_STEPS:
                self.model.observe(features, seconds, predicted)

    # ---- admission control -------------------------------------------------------------------
    def ttft_outlook(self, request: Request, num_to_compute: int, running: list[Request],
                     waiting_ahead: list[tuple[Request, int]], now: float) -> float | None:
        """Predicted time to first token of ``request`` if it were queued now (seconds from
        its arrival; inf past its target), or None when it has no TTFT target or the model is
        not ready. Replays this planner's own rule on the step-time model
        (``core/ttft_forecast.py``): the running requests decode (and finish at their
        ``max_tokens``), the waiting requests ahead of it that are not late are admitted
        through the same gate and prefill budget, then it is.

        Args:
            num_to_compute: its tokens not found in the prefix cache.
            waiting_ahead: the waiting requests admitted before it, each with its tokens not
                found in the prefix cache.
        """
        from kvflow.core.ttft_forecast import forecast_first_token  # it builds on this module

        slo = self.targets_of(request)
        if slo.ttft_s is None or not self.model.is_ready:
            return None
        ahead = [(r, n) for r, n in waiting_ahead if not self.is_late(r, now)]
        horizon = slo.arrival_time + slo.ttft_s - now
        wait = forecast_first_token(self.model, self.config, running, ahead, request,
                                    num_to_compute, self.slos, slo, now, horizon)
        return (now - slo.arrival_time) + wait


def plan_step(model: StepTimeModel, running: Iterable[Request],
              slos: dict[str, RequestSLO], now: float) -> StepBudget:
    """The step's budget for ``running`` (objects with ``request_id``, ``num_tokens``,
    ``num_computed_tokens`` and ``num_output_placeholders``) whose targets are in ``slos``:
    the step may last as long as the
    tightest ``step_allowance`` of a running request (``PLAN_MARGIN`` of it, at most
    ``MAX_STEP_TPOTS`` targets). A request that ``is_lost`` cannot be helped by cutting
    prefill, so it does not shrink the budget (that would starve admissions and help no one);
    with none left to protect the budget is unbounded (the fixed token budget applies).
    Under async scheduling a decode's token from the step in flight is a placeholder, not
    yet in ``num_tokens``, and it is what this step computes: it counts (without it every
    decode looked caught up, the step decode-free, and its first prefill chunk went uncut).
    """
    tpot_min = math.inf
    num_decodes = decode_context = num_running = running_context = 0
    timed: list[tuple[RequestSLO, int]] = []
    for r in running:
        n = r.num_tokens + r.num_output_placeholders
        if n - r.num_computed_tokens == 1:
            num_decodes += 1
            decode_context += n
        num_running += 1
        running_context += n
        slo = slos.get(r.request_id)
        if slo is None or slo.tpot_s is None:
            continue
        tpot_min = min(tpot_min, slo.tpot_s)
        if slo.first_token_time is not None:
            timed.append((slo, n))
    allowed = math.inf  # no running request to keep on target: the fixed budget
    for slo, n in timed:
        if not is_lost(slo, n, model, now):
            allowed = min(allowed, step_allowance(slo, now), MAX_STEP_TPOTS * slo.tpot_s)
    return StepBudget(model, PLAN_MARGIN * allowed, num_decodes, decode_context, num_running,
                      running_context, tpot_min)


def is_unreachable(model: StepTimeModel, tpot_s: float, context_tokens: int) -> bool:
    """Whether no batch can meet a TPOT target of ``tpot_s`` seconds: a step of one decode
    (``context_tokens`` keys) takes longer by the window's fit (not the recent bias: a
    transient slowdown must not open the gate), once the model is settled."""
    return model.is_settled and model.predict_fit(0, 1, context_tokens) > tpot_s


def is_lost(slo: RequestSLO, context_tokens: int, model: StepTimeModel, now: float) -> bool:
    """Whether the request cannot end on its TPOT target any more, however small the batch:
    steps of it decoding alone (``context_tokens`` keys, the model's time) for all the tokens
    it has left would still end past ``f + (k + left) * tpot`` (see ``step_allowance``). A
    target below one decode step is lost from the first token. Unknown ``max_tokens``: lost
    only if one decode alone exceeds the target."""
    if not model.is_settled:
        return False
    floor = model.predict_fit(0, 1, context_tokens)
    if slo.max_tokens is None:
        return floor > slo.tpot_s
    left = max(1, slo.max_tokens - 1 - slo.num_after_first)
    end = slo.first_token_time + (slo.num_after_first + left) * slo.tpot_s
    return now + left * floor > end


def step_allowance(slo: RequestSLO, now: float) -> float:
    """How long (seconds from ``now``) the next step may take and the request still end on
    its TPOT target: the later of its next-token deadline (``f + (k + 1) * tpot`` for a
    request whose first token came at ``f`` with ``k`` tokens since: a request ahead of its
    target spends its slack) and its catch-up pace (``(f + (k + h) * tpot - now) / h``: a
    request behind its target pays its debt back over the next ``h`` tokens, ``h`` =
    ``CATCH_UP_TOKENS`` or the tokens it has left if fewer). The mean TPOT, the SLO's
    definition, is met either way if the later steps keep the same pace.
    """
    tpot, k = slo.tpot_s, slo.num_after_first
    next_deadline = slo.first_token_time + (k + 1) * tpot - now
    left = CATCH_UP_TOKENS if slo.max_tokens is None else slo.max_tokens - 1 - k
    h = max(1, min(CATCH_UP_TOKENS, left))
    return max(next_deadline, (slo.first_token_time + (k + h) * tpot - now) / h)


def step_features(out: SchedulerOutput, requests: dict[str, Request]) -> StepFeatures:
    """The features of a scheduled step (requests' computed counts are already advanced).

    Runs every step, so it sums the computed counts the step's message already holds (C
    speed) and visits only the requests computing more than one token."""
    scheduled = out.num_scheduled_tokens
    computed = sum(out.scheduled_cached_reqs.num_computed_tokens)
    if out.scheduled_new_reqs:
        computed += sum(new.num_computed_tokens for new in out.scheduled_new_reqs)
    if sum(scheduled.values()) == len(scheduled):  # every request decodes (one token each)
        return StepFeatures(0, len(scheduled), computed + len(scheduled))
    chunks = [(rid, n) for rid, n in scheduled.items() if n != 1]
    decodes = len(scheduled) - len(chunks)
    prefill = context = 0
    for rid, n in chunks:
        request = requests.get(rid)
        start = request.num_computed_tokens - n if request is not None else 0
        prefill += n
        context += chunk_context_tokens(start, n)
        computed -= start
    # what is left of ``computed`` is the decodes' cached tokens; each also reads its own key
    return StepFeatures(prefill, decodes, context + computed + decodes)
