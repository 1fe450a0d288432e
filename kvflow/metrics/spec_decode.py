"""Speculative decoding's series of each replica on ``/metrics`` (vLLM's
``spec_decode_*``, names with kvflow's ``kvflow:`` prefix, labels ``model_name`` and
``engine``): drafts, draft tokens and accepted tokens (in total and by position in their
step) as counters, and the acceptance rate and mean acceptance length since start-up as
gauges. Advanced from the cumulative totals of each replica's ``EngineStats``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.engine_outputs import EngineStats


class SpecDecodeMetrics:
    """The families above on ``registry`` (registered in the order listed).

    Args:
        registry: the server's registry.
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        e, r = ("model_name", "engine"), registry
        self.drafts = Counter("kvflow:spec_decode_num_drafts",
                              "Verification steps of a request with draft tokens", e,
                              registry=r)
        self.draft_tokens = Counter("kvflow:spec_decode_num_draft_tokens",
                                    "Draft tokens verified", e, registry=r)
        self.accepted_tokens = Counter("kvflow:spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted", e, registry=r)
        self.accepted_per_pos = Counter(
            "kvflow:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in their step (0 = first)",
            (*e, "position"), registry=r)
        self.acceptance_rate = Gauge("kvflow:spec_decode_draft_acceptance_rate",
                                     "Accepted / verified draft tokens since start-up", e,
                                     registry=r)
        self.mean_acceptance_length = Gauge(
            "kvflow:spec_decode_mean_acceptance_length",
            "Tokens per verification step (1 + accepted / drafts) since start-up", e,
            registry=r)

    def record(self, stats: EngineStats, last: EngineStats, engine: str) -> None:
        """Advance replica ``engine``'s counters by what its totals grew from ``last`` to
        ``stats`` and set its gauges. Every counter's series exists (at 0) from the replica's
        first report on (its start-up), each position's too, as vLLM's do, so that a rate of
        them is 0 rather than absent before the first draft; the two ratios (gauges) appear
        with the first draft."""
        name = self.model_name
        for counter, now, before in (
                (self.drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
                (self.draft_tokens, stats.spec_decode_num_draft_tokens,
                 last.spec_decode_num_draft_tokens),
                (self.accepted_tokens, stats.spec_decode_num_accepted_tokens,
                 last.spec_decode_num_accepted_tokens)):
            series = counter.labels(name, engine)
            if now > before:
                series.inc(now - before)
        before_pos = last.spec_decode_num_accepted_tokens_per_pos
        for pos, now in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            before = before_pos[pos] if pos < len(before_pos) else 0
            series = self.accepted_per_pos.labels(name, engine, str(pos))
            if now > before:
                series.inc(now - before)
        if stats.spec_decode_num_draft_tokens:
            self.acceptance_rate.labels(name, engine).set(
                stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens)
        if stats.spec_decode_num_drafts:
            self.mean_acceptance_length.labels(name, engine).set(
                1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts)
