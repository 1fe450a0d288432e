"""Histogram boundaries of /metrics: vLLM 0.32's defaults (``vllm/v1/metrics/buckets.py``),
so that dashboards made for vLLM, which may read ``le`` values, read kvflow's unchanged.
Times in seconds, counts in tokens (or preemptions)."""

from __future__ import annotations

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # inter-token latency and time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 50000  # token buckets until set_max_model_len is told the real one


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count boundaries: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``
    (tokens) inclusive."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10
