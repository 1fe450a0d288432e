"""The per-request series of /metrics (``RequestStatsTracker``) against hand-computed values
for scripted delta outputs at given times."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.metrics.request_stats import RequestStatsTracker
from kvflow.metrics.server import ServerMetrics
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.sampling_params import RequestOutputKind


def _delta(samples: list[tuple[int, int, str | None]], finished: bool = False) -> RequestOutput:
    """A delta output of request "r": (sample index, new tokens, finish reason) per sample."""
    outs = [CompletionOutput(i, token_ids=[7] * n, finish_reason=reason)
            for i, n, reason in samples]
    return RequestOutput("r", None, [1, 2, 3], outs, finished, RequestMetrics(0.0))


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels.get("le") and "finished_reason" not in s.labels}


def test_ttft_tpot_and_lengths_by_hand():
    """Two samples of a 3-token prompt arriving at t=10: sample 0 gets tokens at 10.5 (1),
    11.0 (2 more), 12.5 (1) and finishes: TPOT (12.5 - 10.5) / 3; sample 1 gets 1 token at
    11.0 and finishes at 11.2 with none more (a one-token sample has no TPOT). As vLLM (where
    each of the n samples is a request of its own) TTFT, prompt tokens and prompt lengths are
    per sample: TTFTs 0.5 and 1.0, 2 x 3 prompt tokens, 2 prompt lengths (was: one TTFT, 3
    prompt tokens and one prompt length for the request, beside 2 generation lengths)."""
    metrics = ServerMetrics("m")
    tracker = RequestStatsTracker(metrics)
    tracker.start("r", 10.0, 3, 2)
    tracker.observe(_delta([(0, 1, None)]), 10.5)
    tracker.observe(_delta([(0, 2, None), (1, 1, None)]), 11.0)
    tracker.observe(_delta([(1, 0, "stop")]), 11.2)
    tracker.observe(_delta([(0, 1, "length")], finished=True), 12.5)
    got = _samples(metrics)
    assert got["kvflow:time_to_first_token_seconds_count"] == 2
    assert got["kvflow:time_to_first_token_seconds_sum"] == 0.5 + 1.0
    assert got["kvflow:request_time_per_output_token_seconds_count"] == 1
    assert abs(got["kvflow:request_time_per_output_token_seconds_sum"] - 2.0 / 3) < 1e-12
    assert got["kvflow:inter_token_latency_seconds_count"] == 2  # 10.5->11.0, 11.0->12.5
    assert got["kvflow:e2e_request_latency_seconds_sum"] == (12.5 - 10) + (11.2 - 10)
    assert got["kvflow:generation_tokens_total"] == 5
    assert got["kvflow:prompt_tokens_total"] == 3 + 3
    assert got["kvflow:request_generation_tokens_sum"] == 4 + 1
    assert got["kvflow:request_prompt_tokens_count"] == 2
    assert got["kvflow:request_prompt_tokens_sum"] == 3 + 3


def test_a_request_that_ends_without_a_token_has_no_ttft():
    """The engine aborted it before its first token (an abort output with no token and no
    error: a refusal with an error is forgotten instead, see below): nothing was served, so
    no time to first token and no prompt tokens are recorded; it counts as aborted, and as a
    finished request its lengths are observed (3 prompt tokens, 0 generated: vLLM's)."""
    metrics = ServerMetrics("m")
    tracker = RequestStatsTracker(metrics)
    tracker.start("r", 10.0, 3, 1)
    tracker.observe(_delta([(0, 0, "abort")], finished=True), 10.2)
    got = _samples(metrics)
    assert got["kvflow:time_to_first_token_seconds_count"] == 0
    assert got["kvflow:prompt_tokens_total"] == 0
    assert metrics.request_success.labels("m", "abort")._value.get() == 1
    assert got["kvflow:request_prompt_tokens_sum"] == 3
    assert got["kvflow:request_generation_tokens_count"] == 1


def open_requests_of(tokenizer, n: int, admission_control: bool = False, output_kind=None):
    """OpenRequests of one server (one replica) holding request "r": ``n`` samples of a
    3-token prompt, arrived at t=10, streamed as ``output_kind`` asks. Returns (metrics, open
    requests, the stream, the sample ids)."""
    from kvflow.engine.dp_balancer import DPLoadBalancer
    from kvflow.engine.open_requests import OpenRequests
    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.inputs.processor import InputProcessor
    from kvflow.sampling_params import SamplingParams

    metrics = ServerMetrics("m")
    requests = InputProcessor(tokenizer, 128, len(tokenizer), tokenizer.eos_token_id) \
        .make_requests("r", [5, 6, 7], SamplingParams(n=n, max_tokens=4,
                                                       output_kind=output_kind))
    open_requests = OpenRequests(OutputProcessor(tokenizer), RequestStatsTracker(metrics),
                                 DPLoadBalancer(1, 16), metrics,
                                 admission_control=admission_control)
    stream = open_requests.open("r", None, requests, 10.0, 0)
    return metrics, open_requests, stream, [r.request_id for r in requests]


def test_a_request_the_core_refuses_is_not_counted_as_finished(tiny_tokenizer):
    """The core refuses both samples of an n=2 request before scheduling them (its grammar
    did not compile): the client gets a 400, so /metrics records nothing for it, as for a
    request admission control refuses (was: 2 samples counted as finished with reason
    abort); a client's abort of a running request still counts."""
    from kvflow.engine.messages import EngineOutputs
    from kvflow.engine.streams import RequestRefused
    from kvflow.engine_outputs import EngineCoreOutput, EngineStats

    metrics, open_requests, stream, sample_ids = open_requests_of(tiny_tokenizer, 2)
    refused = [EngineCoreOutput(sid, [], finish_reason="abort", error="the grammar did not "
                                "compile") for sid in sample_ids]
    open_requests.deliver(EngineOutputs(refused, EngineStats()))
    assert isinstance(stream._queue.get_nowait(), RequestRefused)
    for reason in ("stop", "length", "abort"):
        assert metrics.request_success.labels("m", reason)._value.get() == 0
    assert _samples(metrics)["kvflow:e2e_request_latency_seconds_count"] == 0

    metrics, open_requests, _, sample_ids = open_requests_of(tiny_tokenizer, 2)
    open_requests.deliver(EngineOutputs([EngineCoreOutput(sample_ids[0], [9])], EngineStats()))
    assert open_requests.abort("r")[0] == sample_ids  # the client went away
    assert metrics.request_success.labels("m", "abort")._value.get() == 2


def test_spec_decode_series_exist_at_zero_before_the_first_acceptance():
    """Two verification steps of 2 drafts each, none accepted: the accepted-token counters
    (in total and at positions 0 and 1) are exported at 0 beside the 2 drafts and 4 draft
    tokens (was: absent until a draft token was accepted), the acceptance rate at 0."""
    from kvflow.engine_outputs import EngineStats

    metrics = ServerMetrics("m")
    stats = EngineStats()
    stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = 2, 4
    stats.spec_decode_num_accepted_tokens_per_pos = [0, 0]
    metrics.record_engine_stats(stats)
    got = {(s.name, s.labels.get("position")): s.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for s in fam.samples if s.name.startswith("kvflow:spec_decode")}
    assert got[("kvflow:spec_decode_num_drafts_total", None)] == 2
    assert got[("kvflow:spec_decode_num_draft_tokens_total", None)] == 4
    assert got[("kvflow:spec_decode_num_accepted_tokens_total", None)] == 0
    assert got[("kvflow:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 0
    assert got[("kvflow:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 0
    assert got[("kvflow:spec_decode_draft_acceptance_rate", None)] == 0
    assert got[("kvflow:spec_decode_mean_acceptance_length", None)] == 1


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_token_counts_do_not_depend_on_the_output_kind(tiny_tokenizer, kind):
    """One sample fed 1, 2 and 1 tokens on three steps (the last finishes it): 4 generated
    tokens, 2 inter-token latencies and a generation length of 4 whatever the stream yields
    (was, for CUMULATIVE and FINAL_ONLY, whose outputs hold every token so far: 1 + 3 + 4 = 8
    tokens counted)."""
    from kvflow.engine.messages import EngineOutputs
    from kvflow.engine_outputs import EngineCoreOutput, EngineStats

    metrics, open_requests, _, (sid,) = open_requests_of(tiny_tokenizer, 1, output_kind=kind)
    for tokens, reason in (([9], None), ([10, 11], None), ([12], "length")):
        open_requests.deliver(EngineOutputs(
            [EngineCoreOutput(sid, tokens, finish_reason=reason)], EngineStats()))
    got = _samples(metrics)
    assert got["kvflow:generation_tokens_total"] == 4
    assert got["kvflow:inter_token_latency_seconds_count"] == 2
    assert got["kvflow:request_generation_tokens_sum"] == 4
    assert got["kvflow:request_time_per_output_token_seconds_count"] == 1
    assert metrics.request_success.labels("m", "length")._value.get() == 1


def _bounds(metrics: ServerMetrics, name: str) -> list[float]:
    """The ``le`` boundaries of histogram ``name`` (without +Inf), as /metrics shows them."""
    text = metrics.render().decode()
    return [float(s.labels["le"]) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"]


def test_histogram_boundaries_are_vllms():
    """vLLM 0.32's defaults (vllm/v1/metrics/buckets.py, copied here by hand), so that
    dashboards made for vLLM find the same ``le`` values (was: TTFT's old list, up to 80 s, for
    all four timings, and token lengths up to 50,000 whatever the context length)."""
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0]
    e2e = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
    metrics = ServerMetrics("m", max_model_len=2048)
    assert _bounds(metrics, "kvflow:time_to_first_token_seconds") == ttft
    assert _bounds(metrics, "kvflow:inter_token_latency_seconds") == itl
    assert _bounds(metrics, "kvflow:request_time_per_output_token_seconds") == itl
    assert _bounds(metrics, "kvflow:e2e_request_latency_seconds") == e2e
    lengths = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # 1-2-5 up to 2048
    assert _bounds(metrics, "kvflow:request_prompt_tokens") == lengths
    assert _bounds(metrics, "kvflow:request_generation_tokens") == lengths
    metrics = ServerMetrics("m")
    metrics.set_max_model_len(200)  # a boundary itself is kept
    assert _bounds(metrics, "kvflow:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200]
    tracker = RequestStatsTracker(metrics)
    tracker.start("r", 10.0, 3, 1)
    tracker.observe(_delta([(0, 1, "length")], finished=True), 10.5)
    text = metrics.render().decode()
    assert 'kvflow:request_prompt_tokens_bucket{le="5.0",model_name="m"} 1.0' in text
    assert 'kvflow:request_prompt_tokens_bucket{le="2.0",model_name="m"} 0.0' in text


def test_async_llm_metrics_of_one_request(tiny_llama):
    """Through the engine core process: the context (256 tokens asked, capped to the 252 the
    63 usable 4-token KV blocks hold) ends the length histograms' boundaries (1-2-5 up to
    200); one request of a 6-token prompt and 3 tokens gives 3 steps of 6 + 1, 1 and 1
    tokens (iteration_tokens_total), 6 prompt tokens, one TTFT, 2 inter-token latencies, one
    request in each phase histogram (queue, prefill, decode, inference; no preemption, 6
    prompt tokens computed), and leaves nothing running or waiting and no KV block in use."""
    import asyncio

    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.sampling_params import SamplingParams

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=64, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> None:
        await engine.start()
        try:
            async for _ in engine.add_request("r", None, [5, 6, 7, 8, 9, 10], params):
                pass
        finally:
            await engine.shutdown()

    try:
        assert engine.max_model_len == 252
        assert _bounds(engine.metrics, "kvflow:request_generation_tokens") == \
            [1, 2, 5, 10, 20, 50, 100, 200]
        asyncio.run(run())
    finally:
        engine.close()
    got = {s.name: s.value for fam in text_string_to_metric_families(
        engine.metrics.render().decode()) for s in fam.samples if not s.labels.get("le")}
    assert got["kvflow:iteration_tokens_total_count"] == 3
    assert got["kvflow:iteration_tokens_total_sum"] == 6 + 1 + 1 + 1
    assert got["kvflow:prompt_tokens_total"] == 6
    assert got["kvflow:generation_tokens_total"] == 3
    assert got["kvflow:time_to_first_token_seconds_count"] == 1
    assert got["kvflow:inter_token_latency_seconds_count"] == 2
    assert got["kvflow:num_requests_running"] == got["kvflow:num_requests_waiting"] == 0
    assert got["kvflow:kv_cache_usage_perc"] == 0
    for phase in ("queue", "prefill", "decode", "inference"):  # vLLM's, for the one request
        assert got[f"kvflow:request_{phase}_time_seconds_count"] == 1
    assert got["kvflow:request_num_preemptions_sum"] == 0
    assert got["kvflow:request_prefill_kv_computed_tokens_sum"] == 6


def test_iteration_tokens_observed_per_step_and_replica():
    """Each stats message carries the token counts of the steps since the previous one:
    every count is one observation of its replica's histogram (vLLM's boundaries 1, 8, 16,
    ...), and a replica without steps yet shows an empty series."""
    from kvflow.engine_outputs import EngineStats

    metrics = ServerMetrics("m")
    metrics.record_engine_stats(EngineStats(), 0)
    metrics.record_engine_stats(EngineStats(iteration_tokens=[0, 11, 1]), 1)
    metrics.record_engine_stats(EngineStats(iteration_tokens=[20]), 1)
    got = {(s.name, s.labels["engine"], s.labels.get("le")): s.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for s in fam.samples if s.name.startswith("kvflow:iteration_tokens_total")}
    assert got[("kvflow:iteration_tokens_total_count", "0", None)] == 0
    assert got[("kvflow:iteration_tokens_total_count", "1", None)] == 4
    assert got[("kvflow:iteration_tokens_total_sum", "1", None)] == 0 + 11 + 1 + 20
    assert [got[("kvflow:iteration_tokens_total_bucket", "1", le)]
            for le in ("1.0", "8.0", "16.0", "32.0", "+Inf")] == [2, 2, 3, 4, 4]
    assert _bounds(metrics, "kvflow:iteration_tokens_total")[:4] == [1, 8, 16, 32]


def test_lora_requests_info_is_vllms_gauge():
    """Off until LoRA is enabled (vLLM exports it only with a LoRA config); then each engine
    report sets the series named by ``max_lora`` and the comma-joined running and waiting
    adapters to the report's time (Unix seconds), vLLM's encoding."""
    import time

    from kvflow.engine_outputs import EngineStats

    metrics = ServerMetrics("m")
    metrics.record_engine_stats(EngineStats(running_lora_adapters=["a"]))
    assert "lora_requests_info" not in metrics.render().decode()
    metrics.enable_lora_info(2)
    before = time.time()
    metrics.record_engine_stats(EngineStats(running_lora_adapters=["a"],
                                            waiting_lora_adapters=["b", "c"]))
    (sample,) = [s for fam in text_string_to_metric_families(metrics.render().decode())
                 for s in fam.samples if s.name == "kvflow:lora_requests_info"]
    assert sample.labels == {"model_name": "m", "max_lora": "2", "running_lora_adapters": "a",
                             "waiting_lora_adapters": "b,c"}
    assert before <= sample.value <= time.time()


def test_spec_decode_counters_exist_from_start_up():
    """A replica with 3 speculative tokens reports at start-up, before any draft: its
    counters, each of the 3 positions too, are exported at 0, as vLLM creates them with
    the engine (was: absent until the first draft, so their rates were absent, not 0); the
    two ratio gauges wait for a draft. A replica without speculation exports none."""
    from kvflow.engine_outputs import EngineStats

    metrics = ServerMetrics("m")
    metrics.record_engine_stats(EngineStats(spec_decode_num_accepted_tokens_per_pos=[0, 0, 0]))
    metrics.record_engine_stats(EngineStats(), 1)
    got = {(s.name, s.labels["engine"], s.labels.get("position")): s.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for s in fam.samples
           if s.name.startswith("kvflow:spec_decode") and not s.name.endswith("_created")}
    assert got == {("kvflow:spec_decode_num_drafts_total", "0", None): 0,
                   ("kvflow:spec_decode_num_draft_tokens_total", "0", None): 0,
                   ("kvflow:spec_decode_num_accepted_tokens_total", "0", None): 0,
                   **{("kvflow:spec_decode_num_accepted_tokens_per_pos_total", "0", str(p)): 0
                      for p in range(3)}}


def test_finished_request_phases_observed_per_replica():
    """The finished requests a replica reports are observed into vLLM's phase histograms
    (vLLM's e2e boundaries 0.3 ... 7680 s), preemption counts (1, 2, 3, 4, 5, 10, 20) and
    computed prompt tokens (the length boundaries), under the replica's ``engine`` label."""
    from kvflow.engine_outputs import EngineStats, FinishedRequestStats

    metrics = ServerMetrics("m", max_model_len=100)
    metrics.record_engine_stats(EngineStats(finished_requests=[
        FinishedRequestStats(0.1, 0.4, 2.0, 2.4, 0, 12),
        FinishedRequestStats(1.0, 0.2, 3.0, 3.2, 2, 30)]), 1)
    got = {(s.name, s.labels.get("le")): s.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for s in fam.samples if s.labels.get("engine") == "1"}
    for phase, values in (("queue", (0.1, 1.0)), ("prefill", (0.4, 0.2)),
                          ("decode", (2.0, 3.0)), ("inference", (2.4, 3.2))):
        name = f"kvflow:request_{phase}_time_seconds"
        assert got[(f"{name}_count", None)] == 2
        assert abs(got[(f"{name}_sum", None)] - sum(values)) < 1e-9
        assert got[(f"{name}_bucket", "0.3")] == sum(v <= 0.3 for v in values)
    assert got[("kvflow:request_num_preemptions_sum", None)] == 2
    assert got[("kvflow:request_num_preemptions_bucket", "1.0")] == 1
    assert got[("kvflow:request_prefill_kv_computed_tokens_sum", None)] == 42
    assert got[("kvflow:request_prefill_kv_computed_tokens_bucket", "20.0")] == 1
    assert _bounds(metrics, "kvflow:request_prefill_kv_computed_tokens") == \
        [1, 2, 5, 10, 20, 50, 100]


def test_a_stop_string_finish_counts_in_the_phase_histograms(tiny_llama):
    """A sample ended by a stop string (matched in the API process, then stopped in the
    core) is a finished request in vLLM's phase histograms, as one the core finishes (was:
    stopped as an abort, so missing from them). The stop string is a later token's text of
    the greedy output, taken from a first run without it."""
    import asyncio

    from transformers import AutoTokenizer

    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.sampling_params import SamplingParams

    ids = AutoTokenizer.from_pretrained(tiny_llama.path).encode("prefix caching reuses them,")
    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=64, block_size=4))

    def count(name: str) -> float:
        return next(s.value for f in text_string_to_metric_families(
            engine.metrics.render().decode()) for s in f.samples if s.name == name)

    async def run() -> tuple[list, list, float]:
        await engine.start()
        try:
            greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            first = [o.outputs[0] async for o in engine.add_request("a", None, ids, greedy)]
            texts = [c.text for c in first]
            k = next(i for i, t in enumerate(texts) if i and t.isprintable() and t.strip()
                     and t not in "".join(texts[:i]))
            before = count("kvflow:request_decode_time_seconds_count")
            stop = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[texts[k]])
            second = [o.outputs[0] async for o in engine.add_request("b", None, ids, stop)]
            for _ in range(100):  # the core stops it after the API saw the stop string
                await asyncio.sleep(0.02)
                if count("kvflow:request_decode_time_seconds_count") > before:
                    break
            return second, k, before
        finally:
            await engine.shutdown()

    try:
        second, k, before = asyncio.run(run())
    finally:
        engine.close()
    assert second[-1].finish_reason == "stop"
    assert sum(len(c.token_ids) for c in second) == k + 1
    assert count("kvflow:request_decode_time_seconds_count") == before + 1 == 2


def test_request_parameter_histograms_as_vllms():
    """vLLM's per-request series: ``n`` and the longest sample's length once every sample
    finished (an n=2 request whose samples made 4 and 1 tokens: n 2, longest 4), and
    ``max_tokens`` per finished sample that set it (2 x 4); a request without max_tokens
    adds none of the latter, a client's abort none of the former."""
    metrics = ServerMetrics("m", max_model_len=100)
    tracker = RequestStatsTracker(metrics)
    tracker.start("r", 10.0, 3, 2, max_tokens=4)
    tracker.observe(_delta([(0, 3, None), (1, 1, "stop")]), 10.5)
    got = _samples(metrics)
    assert got["kvflow:request_params_n_count"] == 0  # sample 0 still runs
    assert got["kvflow:request_params_max_tokens_sum"] == 4
    tracker.observe(_delta([(0, 1, "length")], finished=True), 11.0)
    tracker.start("r", 20.0, 3, 1)  # the id again, no max_tokens: its sample is aborted
    tracker.observe(_delta([(0, 1, None)]), 20.5)
    tracker.abort("r")
    got = _samples(metrics)
    assert (got["kvflow:request_params_n_count"], got["kvflow:request_params_n_sum"]) == (1, 2)
    assert got["kvflow:request_max_num_generation_tokens_sum"] == 4
    assert (got["kvflow:request_params_max_tokens_count"],
            got["kvflow:request_params_max_tokens_sum"]) == (2, 8)
    assert _bounds(metrics, "kvflow:request_params_n") == [1, 2, 5, 10, 20]
    assert _bounds(metrics, "kvflow:request_max_num_generation_tokens") == \
        [1, 2, 5, 10, 20, 50, 100]


def test_lora_requests_info_keeps_the_newest_series_only():
    """Each combination of running and waiting adapter names is a series of its own; a
    server loading adapters under new names made new ones without end (vLLM keeps them all).
    The newest ``LORA_INFO_SERIES`` are kept, the current state among them."""
    from kvflow.engine_outputs import EngineStats
    from kvflow.metrics.lora import LORA_INFO_SERIES

    metrics = ServerMetrics("m")
    metrics.enable_lora_info(2)
    for i in range(3 * LORA_INFO_SERIES):
        metrics.record_engine_stats(EngineStats(running_lora_adapters=[f"a{i}"],
                                                waiting_lora_adapters=[f"a{i + 1}"]))
    metrics.record_engine_stats(EngineStats(running_lora_adapters=["a5"]))
    samples = [s for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples if s.name == "kvflow:lora_requests_info"]
    assert len(samples) == LORA_INFO_SERIES
    assert {"running_lora_adapters": "a5", "waiting_lora_adapters": ""}.items() <= \
        next(s for s in samples if s.labels["running_lora_adapters"] == "a5").labels.items()
    running = {s.labels["running_lora_adapters"] for s in samples}
    assert running == {"a5"} | {f"a{i}" for i in range(2 * LORA_INFO_SERIES + 1,
                                                       3 * LORA_INFO_SERIES)}
