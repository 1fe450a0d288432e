"""Serving-benchmark metric math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvflow.bench import metrics


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 50) == pytest.approx(2.5)  # rank 1.5
    assert metrics.percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert metrics.percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert metrics.percentile(values, 100) == 4.0
    assert metrics.percentile([7.0], 99) == 7.0
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError):
        metrics.percentile(values, 101)


def test_percentile_matches_numpy():
    values = list(np.random.default_rng(0).exponential(1.0, 37))
    for p in (1, 25, 50, 90, 99):
        assert metrics.percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_summarize_scales_to_ms():
    s = metrics.summarize([0.010, 0.040, 0.020, 0.030], scale=1e3)
    assert s["mean"] == pytest.approx(25.0)
    assert s["median"] == pytest.approx(25.0)
    assert s["p90"] == pytest.approx(37.0)
    assert s["std"] == pytest.approx(math.sqrt(125.0))  # ((15^2 + 5^2) * 2 / 4) ** 0.5
    assert (s["min"], s["max"]) == (pytest.approx(10.0), pytest.approx(40.0))
    assert math.isnan(metrics.summarize([])["mean"])


def test_request_timing_from_timestamps():
    # sent at 10.0; token chunks at 10.1, 10.15, 10.3; 3 tokens
    t = metrics.request_timing(10.0, [10.1, 10.15, 10.3], 3)
    assert t.ttft == pytest.approx(0.1)
    assert t.e2e == pytest.approx(0.3)
    assert t.itls == pytest.approx((0.05, 0.15))
    assert t.tpot == pytest.approx(0.1)  # (0.3 - 0.1) / (3 - 1)
    # the same chunks carrying 5 tokens (one chunk had several): TPOT uses the token count
    assert metrics.request_timing(10.0, [10.1, 10.15, 10.3], 5).tpot == pytest.approx(0.05)
    one = metrics.request_timing(0.0, [0.2], 1)
    assert one.tpot is None and one.itls == () and one.e2e == pytest.approx(0.2)
    with pytest.raises(ValueError):
        metrics.request_timing(0.0, [], 0)


def _streamed(events: list[tuple[float, dict | str]], endpoint: str = "completions"):
    """A RequestResult sent at t=10.0 that received ``events`` (time, SSE data) in order."""
    import json

    from kvflow.bench.client import RequestResult, _apply_event

    res = RequestResult(start=10.0)
    for now, data in events:
        if not _apply_event(res, data if isinstance(data, str) else json.dumps(data), endpoint,
                            now):
            break
    res.end, res.success = events[-1][0], bool(res.token_times)
    return res


def _summary(results):
    from kvflow.bench.datasets import BenchRequest
    from kvflow.bench.serve_summary import aggregate

    requests = [BenchRequest([5, 6, 7, 8], 4, 8)] * len(results)
    return aggregate(requests, results, 1.0, {}, lambda: None)


def _chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


def _usage(prompt, completion):
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def test_stream_of_only_special_tokens_is_a_completed_request():
    # kvflow serve's stream for a prompt whose one output token is EOS (empty text): the
    # finishing chunk carries the token; vLLM's client counts it too (any chunk with choices)
    res = _streamed([(10.2, _chunk("", "stop")), (10.25, _usage(4, 1)), (10.3, "[DONE]")])
    assert res.token_times == [10.2] and res.completion_tokens == 1
    r = _summary([res])
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (1, 0, 1)
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["mean_e2e_ms"] == pytest.approx(200.0)
    # a role-only chat chunk and the usage chunk carry no token
    chat = _streamed([(10.1, {"choices": [{"index": 0, "delta": {"role": "assistant"},
                                           "finish_reason": None}]}),
                      (10.4, {"choices": [{"index": 0, "delta": {"content": "hi"},
                                           "finish_reason": "length"}]}),
                      (10.5, _usage(4, 1))], endpoint="chat")
    assert chat.token_times == [10.4] and chat.text == "hi"


def test_e2e_ends_at_the_last_token_chunk_not_the_usage_chunk():
    # tokens at 10.1 ("a") and 10.3 ("b", finishing); usage at 10.9; [DONE] at 11.0
    res = _streamed([(10.1, _chunk("a")), (10.3, _chunk("b", "length")), (10.9, _usage(4, 3)),
                     (11.0, "[DONE]")])
    r = _summary([res])
    assert r["mean_e2e_ms"] == pytest.approx(300.0)          # vLLM: latency = last token chunk
    assert r["mean_ttft_ms"] == pytest.approx(100.0)
    assert r["mean_tpot_ms"] == pytest.approx(100.0)         # (300 - 100) / (3 - 1)
    assert r["itls"] == [pytest.approx([0.2])] and r["total_output_tokens"] == 3


def test_ttft_waits_for_a_token_chunk_not_the_role_chunk():
    # kvflow serve sends the chat role chunk at admission (10.01), the first token at 10.4;
    # vLLM's client would take TTFT at the role chunk (10 ms): kvflow's bench takes 400 ms
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]}
    tok = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    last = {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]}
    res = _streamed([(10.01, role), (10.4, tok), (10.6, last), (10.7, _usage(4, 2))],
                    endpoint="chat")
    r = _summary([res])
    assert r["mean_ttft_ms"] == pytest.approx(400.0)
    assert r["itls"] == [pytest.approx([0.2])] and r["mean_tpot_ms"] == pytest.approx(200.0)


def test_chunks_of_tokens_without_text_yet_are_token_chunks():
    # vLLM's server streams one chunk per step, its text empty while a character's UTF-8
    # bytes are incomplete: " a" at 10.1, the first byte of an emoji at 10.2 (""), the rest
    # at 10.3, then "b" at 10.4 (finishing): 4 tokens, 3 gaps of 100 ms (was: the empty
    # chunk skipped, 2 gaps of 100 and 200 ms)
    res = _streamed([(10.1, _chunk(" a")), (10.2, _chunk("")), (10.3, _chunk("\U0001F600")),
                     (10.4, _chunk("b", "length")), (10.5, _usage(4, 4))])
    assert res.token_times == [10.1, 10.2, 10.3, 10.4] and res.text == " a\U0001F600b"
    r = _summary([res])
    assert r["itls"] == [pytest.approx([0.1, 0.1, 0.1])]
    assert r["mean_tpot_ms"] == pytest.approx(100.0)
    # a first token without text: TTFT is its chunk's (was: the next one's, 200 ms)
    first = _streamed([(10.1, _chunk("")), (10.2, _chunk("\u00e9", "length"))])
    assert _summary([first])["mean_ttft_ms"] == pytest.approx(100.0)
    # chat: the role chunk carries no token, a later empty content chunk does
    chat = _streamed([(10.05, {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""}}]}),
                      (10.1, {"choices": [{"index": 0, "delta": {"content": ""}}]}),
                      (10.2, {"choices": [{"index": 0, "delta": {"content": "\u00e9"},
                                           "finish_reason": "length"}]})], endpoint="chat")
    assert chat.token_times == [10.1, 10.2] and chat.text == "\u00e9"
    # a final usage chunk whose choice is empty carries no token either (E2E stays at 10.2)
    usage_in_choice = {"choices": [{"index": 0, "text": "", "finish_reason": None}],
                       "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    late = _streamed([(10.1, _chunk("a")), (10.2, _chunk("b", "length")),
                      (10.6, usage_in_choice)])
    assert late.token_times == [10.1, 10.2] and late.completion_tokens == 2


def test_reasoning_and_tool_call_chunks_carry_tokens():
    # a server with a reasoning parser streams the thinking as reasoning_content deltas
    # (10.1, 10.2), then the answer as content (10.9), then a tool call's pieces (11.0, 11.1):
    # every one of them carries generated tokens, so TTFT is the first reasoning chunk's
    # (was: the first content chunk's, 900 ms, and the 10.2 -> 10.9 gap was one ITL)
    def delta(finish=None, **fields):
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}

    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "get", "arguments": ""}}
    args = {"index": 0, "function": {"arguments": '{"x": 1}'}}
    res = _streamed([(10.01, delta(role="assistant", content="")),
                     (10.1, delta(reasoning_content="Let me")),
                     (10.2, delta(reasoning_content=" think")),
                     (10.9, delta(content="Sure")),
                     (11.0, delta(tool_calls=[call])),
                     (11.1, delta("tool_calls", tool_calls=[args])),
                     (11.2, _usage(4, 6))], endpoint="chat")
    assert res.token_times == [10.1, 10.2, 10.9, 11.0, 11.1]
    assert res.text == 'Let me thinkSureget{"x": 1}'
    r = _summary([res])
    assert r["mean_ttft_ms"] == pytest.approx(100.0)
    assert r["itls"] == [pytest.approx([0.1, 0.7, 0.1, 0.1])]
    assert r["mean_tpot_ms"] == pytest.approx(200.0)  # (1100 - 100) / (6 - 1)
    # vLLM's newer field name; a server sending both names (the same text) counts it once
    both = _streamed([(10.3, delta(reasoning="a", reasoning_content="a")),
                      (10.4, delta("stop", reasoning="b"))], endpoint="chat")
    assert both.token_times == [10.3, 10.4] and both.text == "ab"


def test_result_has_vllm_e2el_keys():
    # two requests: last token chunks at 10.3 and 10.5 (sent at 10.0) -> E2E 300 and 500 ms
    a = _streamed([(10.1, _chunk("a")), (10.3, _chunk("b", "length")), (10.4, _usage(4, 2))])
    b = _streamed([(10.2, _chunk("a")), (10.5, _chunk("b", "length")), (10.6, _usage(4, 2))])
    r = _summary([a, b])
    # the keys vLLM's result-parsing scripts read, next to kvflow's *_e2e_ms
    assert r["mean_e2el_ms"] == pytest.approx(400.0) == r["mean_e2e_ms"]
    assert r["median_e2el_ms"] == pytest.approx(400.0)
    assert r["std_e2el_ms"] == pytest.approx(100.0)       # population std of 300, 500
    assert r["p99_e2el_ms"] == pytest.approx(498.0)       # 300 + 200 * 0.99
    assert r["latencies"] == [pytest.approx(0.3), pytest.approx(0.5)]  # vLLM's list, seconds


def test_peak_output_throughput_and_concurrency_are_vllms():
    # sent at 10.0, 10.5 and 11.9; token chunks as listed; one-second buckets from 10.0, 4 of
    # them (ceil(12.6 - 10.0) + 1). Chunks per bucket: [10.2, 10.9 | 11.1, 11.5, 11.3 |
    # 12.05, 12.6 | -] = [2, 3, 2, 0]; active requests per bucket: A in 0-1, B in 0-2, C in
    # 1-2 = [2, 3, 2, 0]. vLLM 0.32's calculate_metrics on the same requests: (3.0, 3)
    starts = [10.0, 10.5, 11.9]
    times = [[10.2, 10.9, 11.1, 11.5], [11.3, 12.05], [12.6]]
    assert metrics.peak_per_second(starts, times) == (3.0, 3)
    assert metrics.peak_per_second([], []) == (0.0, 0)


def test_result_has_vllms_peak_goodput_and_start_time_keys():
    a = _streamed([(10.1, _chunk("a")), (10.3, _chunk("b", "length")), (10.4, _usage(4, 2))])
    b = _streamed([(11.2, _chunk("a")), (11.5, _chunk("b", "length")), (11.6, _usage(4, 2))])
    b.start = 10.9
    failed = _failed()
    r = _summary([a, b, failed])
    # chunks per second from 10.0: [10.1, 10.3 | 11.2, 11.5] -> 2; a in 0, b in 0-1 -> 2
    assert (r["max_output_tokens_per_s"], r["max_concurrent_requests"]) == (2.0, 2)
    assert r["start_times"] == [10.0, 10.9]    # completed requests, as kvflow's other lists
    assert r["request_goodput"] is None         # vLLM writes null without --goodput


def _failed():
    """A request that failed (sent at 9.0, before the others): it is in no statistic."""
    from kvflow.bench.client import RequestResult

    return RequestResult(success=False, start=9.0, error="HTTP 503: busy")


def test_summary_follows_vllms_definitions():
    # vLLM 0.32's calculate_metrics rules, hand-computed over 2.0 s: A sent at 10.0 streams
    # "a" at 10.1, then one chunk of 3 tokens at 10.3, then the finishing token at 10.4 (5
    # tokens per usage); B's only token comes at 10.25; C fails (HTTP 503). vLLM's own
    # calculate_metrics, given the same requests, gives every figure asserted here
    from kvflow.bench.client import RequestResult
    from kvflow.bench.datasets import BenchRequest
    from kvflow.bench.serve_summary import aggregate

    a = _streamed([(10.1, _chunk("a")), (10.3, _chunk("bcd")), (10.4, _chunk("e", "length")),
                   (10.5, _usage(4, 5))])
    b = _streamed([(10.25, _chunk("x", "stop")), (10.3, _usage(4, 1))])
    c = RequestResult(success=False, start=10.0, error="HTTP 503: busy")
    reqs = [BenchRequest([5, 6, 7, 8], 4, 8)] * 3
    r = aggregate(reqs, [a, b, c], 2.0, metrics.parse_goodput(["ttft:250", "tpot:80"]),
                  lambda: None)
    assert (r["completed"], r["failed"]) == (2, 1)         # the failure counts nowhere else
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (8, 6)
    assert r["request_throughput"] == pytest.approx(1.0)    # 2 completed / 2.0 s
    assert r["output_throughput"] == pytest.approx(3.0)     # 6 / 2.0
    assert r["total_token_throughput"] == pytest.approx(7.0)  # (8 + 6) / 2.0
    # one ITL per chunk, not per token: A's gaps are 200 and 100 ms (not 5 - 1 = 4 gaps)
    assert r["itls"] == [pytest.approx([0.2, 0.1]), []]
    assert r["mean_itl_ms"] == pytest.approx(150.0) and r["p99_itl_ms"] == pytest.approx(199.0)
    # TPOT over requests of >= 2 tokens only: A's (400 - 100) / (5 - 1) = 75 ms; B has none
    assert r["mean_tpot_ms"] == pytest.approx(75.0) and r["median_tpot_ms"] == pytest.approx(75.0)
    assert r["mean_ttft_ms"] == pytest.approx(175.0) and r["std_ttft_ms"] == pytest.approx(75.0)
    # goodput: B's TTFT of exactly 250 ms meets ttft:250 (value <= SLO), its missing TPOT
    # meets tpot:80; A meets both -> 2 good / 2.0 s
    assert (r["good_requests"], r["request_goodput"]) == (2, pytest.approx(1.0))
    tighter = aggregate(reqs, [a, b, c], 2.0, metrics.parse_goodput(["ttft:249.9"]),
                        lambda: None)
    assert (tighter["good_requests"], tighter["request_goodput"]) == (1, pytest.approx(0.5))


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:500", "tpot:50", "e2e:2000"]) == {
        "ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    # vLLM's name for the end-to-end SLO is e2el
    assert metrics.parse_goodput(["e2el:1500", "ttft:20"]) == {"e2e": 1.5, "ttft": 0.02}
    for bad in (["ttft"], ["itl:5"], ["ttft:0"], ["ttft:5", "ttft:9"], ["e2e:5", "e2el:9"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)


def test_goodput_counts_requests_meeting_every_slo():
    timings = [metrics.RequestTiming(ttft=0.1, tpot=0.02, e2e=1.0, itls=()),   # good
               metrics.RequestTiming(ttft=0.6, tpot=0.02, e2e=1.0, itls=()),   # TTFT too slow
               metrics.RequestTiming(ttft=0.1, tpot=0.06, e2e=1.0, itls=()),   # TPOT too slow
               metrics.RequestTiming(ttft=0.2, tpot=None, e2e=0.2, itls=())]   # 1 token: good
    slos = {"ttft": 0.5, "tpot": 0.05}
    assert metrics.goodput(timings, slos, duration_s=4.0) == (2, 0.5)
    assert metrics.goodput(timings, {"e2e": 0.5}, duration_s=2.0) == (1, 0.5)
    assert metrics.goodput(timings, {}, duration_s=2.0) == (4, 2.0)


def test_failures_counted_by_kind():
    from kvflow.bench.serve_summary import error_kinds

    errors = ['HTTP 503: {"error": {}}', "HTTP 503: x", "TimeoutError: no complete response",
              'error event in stream: {"code": "engine_dead"}', "HTTP 400: bad"]
    assert error_kinds(errors) == {"HTTP 503": 2, "TimeoutError": 1,
                                   "error event in stream": 1, "HTTP 400": 1}
    assert error_kinds([]) == {}
