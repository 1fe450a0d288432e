"""vLLM's ``lora_requests_info`` gauge (``/metrics``: ``kvflow:lora_requests_info``), exported
with LoRA serving on (``--enable-lora``). Each engine report sets the series of its labels
``max_lora``, ``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter names,
comma-separated) to the time it came (Unix seconds), as vLLM's does; the newest series is the
current state. Not per replica (vLLM's has no ``engine`` label). Only the ``LORA_INFO_SERIES``
series set last are kept (vLLM keeps every combination of adapter names ever reported: a
server that loads adapters under new names grew without bound, in memory and in each
/metrics reply).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvflow.engine_outputs import EngineStats

LORA_INFO_SERIES = 32  # lora_requests_info series kept: the newest label sets


class LoraInfoMetrics:
    """The ``lora_requests_info`` gauge of one server, registered when made.

    Args:
        registry: the server's registry.
        model_name: value of the ``model_name`` label.
        max_loras: adapters a step may run (the ``max_lora`` label).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int) -> None:
        self.model_name, self.max_loras = model_name, max_loras
        self.gauge = Gauge("kvflow:lora_requests_info", "Running stats on LoRA requests: "
                           "adapters running and waiting (value: the time of the report, s)",
                           ("model_name", "max_lora", "waiting_lora_adapters",
                            "running_lora_adapters"), registry=registry)
        self._labels: dict[tuple[str, ...], None] = {}  # its series, oldest first

    def record(self, stats: EngineStats) -> None:
        """Set the series of ``stats``' running and waiting adapters to now."""
        self._set((self.model_name, str(self.max_loras), ",".join(stats.waiting_lora_adapters),
                   ",".join(stats.running_lora_adapters)))

    def _set(self, labels: tuple[str, ...]) -> None:
        """Set the series of ``labels`` to now; drop the series set longest ago beyond the
        newest ``LORA_INFO_SERIES``."""
        self.gauge.labels(*labels).set_to_current_time()
        self._labels.pop(labels, None)
        self._labels[labels] = None
        if len(self._labels) > LORA_INFO_SERIES:
            oldest = next(iter(self._labels))
            del self._labels[oldest]
            self.gauge.remove(*oldest)
