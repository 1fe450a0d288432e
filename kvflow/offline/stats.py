"""The offline ``LLM``'s metrics (``LLM(disable_log_stats=False)``, then ``get_metrics()``):
the server's :class:`~kvflow.metrics.server.ServerMetrics` and
:class:`~kvflow.metrics.server.RequestStatsTracker`, fed by the LLM's steps instead of the API
process's output loop, so the offline numbers are the ``/metrics`` ones (same names, types,
buckets and rules), read as vLLM's reader reads them (:mod:`kvflow.metrics_reader`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvflow.engine.dp_client import DPCoreClient
from kvflow.metrics.request_stats import RequestStatsTracker
from kvflow.metrics.server import ServerMetrics
from kvflow.metrics_reader import Metric, metrics_snapshot
from kvflow.outputs import RequestOutput


class OfflineStats:
    """Per-request and engine metrics of one offline LLM.

    Args:
        model_name: the ``model_name`` label (the ``model`` the LLM was given, as vLLM's).
        max_model_len: the engine's context length (the length histograms' last boundary).
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.metrics = ServerMetrics(model_name, max_model_len)
        self.tracker = RequestStatsTracker(self.metrics)
        self._open: set[str] = set()
        self._max_tokens: dict[str, int | None] = {}  # request -> its max_tokens parameter
        self._tokens: dict[tuple[str, int], int] = {}  # (request, sample) -> tokens seen

    def record_cache_config(self, engine: Any) -> None:
        """Each replica's ``cache_config_info`` series (vLLM's) for the started ``engine``
        (an ``LLMEngine``): an in-process core's pool and prefix caching, or for every
        replica of a data-parallel engine replica 0's (they run one configuration)."""
        core = engine.core
        if isinstance(core, DPCoreClient):
            ready = core.ready
            num_blocks, caching, replicas = \
                ready.num_blocks, ready.enable_prefix_caching, core.num_replicas
        else:
            num_blocks, caching, replicas = \
                core.num_blocks, core.kv_cache_manager.enable_prefix_caching, 1
        for index in range(replicas):
            self.metrics.cache_config_info.set(index, engine.config.cache_config, num_blocks,
                                               caching)

    def queued(self, request_id: str, max_tokens: int | None) -> None:
        """A generation request was queued with this ``max_tokens`` (None: not set)."""
        self._max_tokens[request_id] = max_tokens

    def observe(self, output: Any) -> None:
        """Record one step's output of a request (a cumulative RequestOutput, or a pooling
        output): the tracker sees what is new since the last one."""
        rid = output.request_id
        if rid not in self._open:
            self._open.add(rid)
            samples = len(output.outputs) if isinstance(output.outputs, list) else 1
            self.tracker.start(rid, output.metrics.arrival_time,
                               len(output.prompt_token_ids or ()), samples,
                               max_tokens=self._max_tokens.pop(rid, None))
        self.tracker.observe(self._delta(output), time.monotonic())
        if output.finished:
            self._forget(output)

    def _delta(self, output: Any) -> Any:
        """``output`` with each sample's tokens cut to those it did not have before (the
        tracker reads delta outputs)."""
        if not isinstance(output, RequestOutput):
            return output
        samples = []
        for s in output.outputs:
            seen = self._tokens.get((output.request_id, s.index), 0)
            self._tokens[(output.request_id, s.index)] = len(s.token_ids)
            samples.append(dataclasses.replace(s, token_ids=s.token_ids[seen:]))
        return dataclasses.replace(output, outputs=samples)

    def _forget(self, output: Any) -> None:
        self._open.discard(output.request_id)
        for s in output.outputs if isinstance(output.outputs, list) else ():
            self._tokens.pop((output.request_id, s.index), None)

    def aborted(self, request_id: str) -> None:
        """The request was aborted before it finished: its open samples count as ``abort``."""
        self.tracker.abort(request_id)
        self._open.discard(request_id)
        self._max_tokens.pop(request_id, None)
        self._tokens = {k: v for k, v in self._tokens.items() if k[0] != request_id}

    def snapshot(self, engine_stats: list[Any]) -> list[Metric]:
        """Every series after recording ``engine_stats`` (each replica's
        ``EngineStats`` now, by index), in vLLM's reader's shape."""
        for index, stats in enumerate(engine_stats):
            self.metrics.record_engine_stats(stats, index)
        return metrics_snapshot(self.metrics.registry)
