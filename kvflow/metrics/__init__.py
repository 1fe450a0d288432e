"""The server's Prometheus metrics (``GET /metrics``), named as vLLM 0.32 names them: ``server``
(``ServerMetrics``, the registry), ``request_stats`` (per-request series), ``buckets``
(histogram boundaries) and the info and per-replica series (``cache_config``, ``lora``,
``prompt_sources``, ``spec_decode``). Their snapshot as vLLM's reader gives it is
``kvflow.metrics_reader`` (a public path).
"""
