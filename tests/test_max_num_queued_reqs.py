"""vLLM's ``--max-num-queued-reqs L``: a request whose sequences (``n`` per prompt) would take
those in flight, waiting or running, past L gets 503 ``server_overloaded`` with Retry-After
(vLLM's ``AsyncLLM.check_admission``); unlike ``--max-waiting-requests`` running requests
count; a request that alone has more sequences than L is a 400 naming ``n`` or the prompt
field (it could never be admitted); each 503 is counted on /metrics as
``kvflow:requests_overloaded`` and vLLM's ``admission_rejections{reason="max_num_queued_reqs"}``.
The serving check over a stand-in engine (counts hand-set, the server's real metrics), and the count itself from ``OutputProcessor`` (samples of the requests in flight, gone once a request finishes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvflow.config import ServerConfig
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.serving_checks import OpenAIServingChecks
from kvflow.inputs.processor import InputProcessor
from kvflow.metrics.server import ServerMetrics
from kvflow.sampling_params import SamplingParams


def _checks(in_flight: int, waiting: int = 0, *argv: str) -> OpenAIServingChecks:
    checks = OpenAIServingChecks()
    checks.config = ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]),
                                               env={})
    checks.engine = SimpleNamespace(is_healthy=True, num_open_sequences=in_flight,
                                    num_waiting_requests=waiting, metrics=ServerMetrics("m"))
    return checks


def _refusals(checks: OpenAIServingChecks) -> tuple[float, float, float]:
    """/metrics' ``requests_overloaded`` and vLLM's ``admission_rejections`` by reason
    (``max_num_queued_reqs``, ``max_num_queued_tokens``) on the stand-in's registry."""
    registry = checks.engine.metrics.registry
    return (registry.get_sample_value("kvflow:requests_overloaded_total", {"model_name": "m"}),
            *(registry.get_sample_value("kvflow:admission_rejections_total",
                                        {"model_name": "m", "reason": reason})
              for reason in ("max_num_queued_reqs", "max_num_queued_tokens")))


@pytest.mark.parametrize("in_flight,prompts,n,admitted", [
    (0, 1, 1, True), (3, 1, 1, True), (4, 1, 1, False), (2, 1, 2, True), (3, 1, 2, False),
    (1, 2, 2, False), (0, 2, 2, True),
])
def test_sequences_counted_against_the_limit(in_flight, prompts, n, admitted):
    checks = _checks(in_flight, 0, "--max-num-queued-reqs", "4")
    if admitted:
        checks.check_admission(prompts, n=n)
        return
    with pytest.raises(OpenAIError) as info:
        checks.check_admission(prompts, n=n)
    e = info.value
    assert (e.status, e.code, e.headers) == (503, "server_overloaded", {"Retry-After": "1"})
    assert "--max-num-queued-reqs" in str(e)
    assert _refusals(checks) == (1, 1, 0)  # vLLM's reason; kvflow has no token limit


@pytest.mark.parametrize("prompts,n,param,code", [
    (1, 5, "n", "integer_above_max_value"), (5, 1, "prompt", "too_many_prompts"),
    (2, 3, "n", "integer_above_max_value"),
])
def test_a_request_that_alone_exceeds_the_limit_is_a_400(prompts, n, param, code):
    """Was 503 + Retry-After: a request with more sequences than L can never be admitted, so
    a client obeying Retry-After retried forever. Now a 400 naming ``n`` (or the prompt
    field) with no Retry-After, as ``--max-waiting-requests`` answers too many prompts; not
    counted as overloaded. A request of exactly L sequences is still admitted."""
    checks = _checks(0, 0, "--max-num-queued-reqs", "4")
    with pytest.raises(OpenAIError) as info:
        checks.check_admission(prompts, n=n)
    e = info.value
    assert (e.status, e.param, e.code, e.headers) == (400, param, code, None)
    assert "--max-num-queued-reqs" in str(e) and f"{prompts * n}" in str(e)
    assert _refusals(checks) == (0, 0, 0)
    with pytest.raises(OpenAIError) as info:  # the embeddings field is named as such
        checks.check_admission(5, "input")
    assert (info.value.status, info.value.param) == (400, "input")
    checks.check_admission(2, n=2)
    checks.check_admission(4, "input")


def test_unset_admits_any_and_running_requests_count_only_here():
    _checks(10_000).check_admission(8, n=8)
    # 3 waiting is under --max-waiting-requests 4, but 5 in flight reach the queued limit
    with pytest.raises(OpenAIError, match="max-num-queued-reqs"):
        _checks(5, 3, "--max-waiting-requests", "4",
                "--max-num-queued-reqs", "5").check_admission(1)


def test_open_samples_counted_until_the_request_finishes(tiny_tokenizer):
    processor = InputProcessor(tiny_tokenizer, 128, len(tiny_tokenizer),
                               tiny_tokenizer.eos_token_id)
    out = OutputProcessor(tiny_tokenizer)
    three = processor.make_requests("a", [5, 6], SamplingParams(n=3, max_tokens=1))
    out.add_request(None, three, delta=True)
    out.add_request(None, processor.make_requests("b", [5], SamplingParams(max_tokens=4)),
                    delta=True)
    assert out.num_open_samples == 4
    out.process([EngineCoreOutput(r.request_id, [7], None, "length") for r in three])
    assert out.num_open_samples == 1


def test_flag(capsys):
    assert ServerConfig.from_cli_args(build_parser().parse_args(
        ["serve", "--max-num-queued-reqs", "64"]), env={}).max_num_queued_reqs == 64
    assert main(["serve", "m", "--max-num-queued-reqs", "0"]) == 2
    assert "max-num-queued-reqs" in capsys.readouterr().err


def test_the_waiting_limit_is_not_one_of_vllms_admission_rejections():
    """``--max-waiting-requests`` (kvflow's; vLLM has no such limit) counts as overloaded
    only: vLLM's two reasons stay 0."""
    checks = _checks(0, 4, "--max-waiting-requests", "4")
    with pytest.raises(OpenAIError, match="4 requests are waiting"):
        checks.check_admission(1)
    assert _refusals(checks) == (1, 0, 0)
