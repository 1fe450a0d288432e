"""vLLM's ``--stream-interval N``: a stream's first token goes out at once, then its new tokens
every N tokens, and the finishing output at once (vLLM's ``RequestState.make_request_output``);
the joined deltas still add up to the whole output (text, ids, logprobs), while the metrics
see every engine step (ITL per step, not per streamed chunk). Checked on ``OpenRequests`` fed
one token per step (and three per step, as speculative decoding gives), the expected token
counts per streamed output hand-computed; the flag reaches ``SchedulerConfig``."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.config import EngineConfig
from kvflow.engine.dp_balancer import DPLoadBalancer
from kvflow.engine.messages import EngineOutputs
from kvflow.engine.open_requests import OpenRequests
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine_outputs import EngineCoreOutput, EngineStats
from kvflow.entrypoints.cli import build_parser
from kvflow.inputs.processor import InputProcessor
from kvflow.metrics.request_stats import RequestStatsTracker
from kvflow.metrics.server import ServerMetrics
from kvflow.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _stream(tokenizer, interval: int, tokens: int, per_step: int = 1, n: int = 1,
            own: int | None = None):
    """Feed ``tokens`` tokens ``per_step`` a step to every sample of one request (its own
    ``stream_interval`` ``own``); returns the outputs its stream got (sample 0's token count
    per output, finished), sample 0's text and logprobs joined from them, the tokens fed, and
    the ITL observations counted."""
    token_ids = (tokenizer.encode("the quick brown fox jumps over a lazy dog") * 3)[:tokens]
    requests = InputProcessor(tokenizer, 128, len(tokenizer), tokenizer.eos_token_id) \
        .make_requests("r", PROMPT, SamplingParams(n=n, max_tokens=tokens, logprobs=0,
                                                   stream_interval=own))
    metrics = ServerMetrics("m")
    open_requests = OpenRequests(OutputProcessor(tokenizer), RequestStatsTracker(metrics),
                                 DPLoadBalancer(1, 16), metrics, False, interval)
    stream = open_requests.open("r", None, requests, 10.0, 0)
    for start in range(0, tokens, per_step):
        chunk = token_ids[start:start + per_step]
        last = start + per_step >= tokens
        open_requests.deliver(EngineOutputs([EngineCoreOutput(
            r.request_id, chunk, [([t], [-0.5], -0.5, 1) for t in chunk],
            "length" if last else None) for r in requests], EngineStats()))
    got, text, logprobs = [], "", []
    while not stream._queue.empty():
        out = stream._queue.get_nowait()
        sample = next(c for c in out.outputs if c.index == 0)
        got.append((len(sample.token_ids), out.finished))
        text += sample.text
        logprobs += sample.logprobs
    itl = next(s.value for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if s.name == "kvflow:inter_token_latency_seconds_count")
    return got, text, logprobs, token_ids, itl, open_requests


@pytest.mark.parametrize("interval,tokens,per_step,expected", [
    (1, 4, 1, [1, 1, 1, 1]),
    (3, 10, 1, [1, 3, 3, 3]),  # first at once, then every 3; the 10th token ends it
    (4, 10, 1, [1, 4, 4, 1]),  # the last output is sent at once, short
    (5, 3, 1, [1, 2]),
    (4, 12, 3, [3, 6, 3]),  # 3 tokens a step: 3 sent, then 6 (>= 4), then the final 3
])
def test_outputs_held_to_the_interval(tiny_tokenizer, interval, tokens, per_step, expected):
    got, text, logprobs, token_ids, itl, open_requests = _stream(tiny_tokenizer, interval,
                                                                 tokens, per_step)
    assert [count for count, _ in got] == expected
    assert [finished for _, finished in got] == [False] * (len(expected) - 1) + [True]
    assert text == tiny_tokenizer.decode(token_ids)
    assert [next(iter(lp)) for lp in logprobs] == token_ids
    assert itl == tokens // per_step - 1  # one per engine step after the first
    assert not open_requests.streams and not open_requests.stream_interval._held


@pytest.mark.parametrize("interval,own,tokens,expected", [
    (1, 3, 10, [1, 3, 3, 3]),  # the request's own interval, above the engine's 1
    (1, 4, 10, [1, 4, 4, 1]),
    (4, 2, 10, [1, 4, 4, 1]),  # below the engine's 4: raised to it (vLLM's clamp)
    (1, 1, 4, [1, 1, 1, 1]),
    (3, None, 10, [1, 3, 3, 3]),  # None: the engine's
])
def test_a_request_s_own_interval(tiny_tokenizer, interval, own, tokens, expected):
    """vLLM 0.32's per-request ``stream_interval``: the larger of it and the engine's; it is
    forgotten once the request finishes."""
    got, text, _, token_ids, _, open_requests = _stream(tiny_tokenizer, interval, tokens,
                                                        own=own)
    assert [count for count, _ in got] == expected
    assert text == tiny_tokenizer.decode(token_ids)
    assert not open_requests.stream_interval._own and not open_requests.stream_interval._held


def test_own_interval_refused_below_one():
    with pytest.raises(ValueError, match="stream_interval=0 is invalid: it must be an "
                                         "integer >= 1"):
        SamplingParams(stream_interval=0)


def test_several_samples(tiny_tokenizer):
    got, *_ = _stream(tiny_tokenizer, 3, 7, n=2)
    assert [count for count, _ in got] == [1, 3, 3]


def test_flag():
    args = build_parser().parse_args(["serve", "m", "--stream-interval", "8"])
    assert EngineConfig.from_cli_args(args).scheduler_config.stream_interval == 8
    assert EngineConfig.from_kwargs(stream_interval=2).scheduler_config.stream_interval == 2
    with pytest.raises(ValueError, match="stream_interval=0 must be >= 1"):
        EngineConfig.from_kwargs(stream_interval=0)
