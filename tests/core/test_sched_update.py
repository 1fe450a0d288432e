"""``update_from_output``'s plain path: a decode's one token that cannot finish its request
is appended without ``_sampled_output`` (``sched_update._appended_plainly``).

Oracles: the fake runner's scripted tokens and ``default_sample``'s greedy continuation
(tests/core/conftest.py) for the outputs, finish and stop reasons; hand-counted output
positions for the tokens that must take the full path (a request's first token, and the one
that finishes it: EOS or a stop id once ``min_tokens`` are out, the length limit).
"""

from __future__ import annotations

import pytest

from kvflow.core import sched_update
from kvflow.sampling.repetition_detection import RepetitionDetectionParams
from tests.core.test_async_schedule import run_async

EOS = 1  # the conftest default eos_token_id


def _count_full_path(monkeypatch) -> dict[str, list[int]]:
    """Request id -> the output position (1-based) of each token ``_sampled_output`` folds in."""
    calls: dict[str, list[int]] = {}
    real = sched_update._sampled_output

    def counted(sched, sched_out, runner_output, request, token_ids, *args):
        calls.setdefault(request.request_id, []).append(request.num_output_tokens + 1)
        return real(sched, sched_out, runner_output, request, token_ids, *args)

    monkeypatch.setattr(sched_update, "_sampled_output", counted)
    return calls


# request id -> (prompt, script, SamplingParams fields, output tokens, finish and stop
# reasons, output positions through _sampled_output)
CASES = {
    "len": ([2, 3, 4], [], {"max_tokens": 8}, None, ("length", None), [1, 8]),
    "eos": ([5, 6], [7, 8, 9, EOS, 9], {}, [7, 8, 9, EOS], ("stop", None), [1, 4]),
    # the EOS at position 2 is sampled before min_tokens are out: appended plainly
    "min": ([7, 8, 9], [7, EOS, 42, 8, 42], {"min_tokens": 3, "stop_token_ids": [42]},
            [7, EOS, 42, 8, 42], ("stop", 42), [1, 5]),
    "stop_id": ([10], [7, 8, 42, 9], {"stop_token_ids": [42]}, [7, 8, 42], ("stop", 42),
                [1, 3]),
    "ignore_eos": ([11, 12], [EOS, 7, EOS, EOS, 8], {"ignore_eos": True, "max_tokens": 5},
                   [EOS, 7, EOS, EOS, 8], ("length", None), [1, 5]),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_only_first_and_finishing_tokens_take_the_full_path(
        make_scheduler, make_driver, make_request, oracle, monkeypatch, async_scheduling):
    calls = _count_full_path(monkeypatch)
    sched = make_scheduler(async_scheduling=async_scheduling)
    driver = make_driver(sched, {rid: case[1] for rid, case in CASES.items()})
    for rid, (prompt, _, params, *_) in CASES.items():
        driver.add(make_request(rid, prompt, **params))
    if async_scheduling:
        run_async(driver)
    else:
        driver.run()
    for rid, (prompt, _, params, tokens, reasons, full_path) in CASES.items():
        result = driver.results[rid]
        want = tokens if tokens is not None else oracle(prompt, params["max_tokens"])
        assert result.output_token_ids == want, rid
        assert (result.finish_reason, result.stop_reason) == reasons, rid
        assert calls[rid] == full_path, rid


def test_repetition_detection_keeps_the_full_path(make_scheduler, make_driver, make_request,
                                                  monkeypatch):
    """A request with repetition detection: every token is checked for a repeated n-gram,
    and the request stops at the second repetition of ``[7, 8]``."""
    calls = _count_full_path(monkeypatch)
    sched = make_scheduler()
    driver = make_driver(sched, {"r": [7, 8, 7, 8, 9, 9]})
    detection = RepetitionDetectionParams(max_pattern_size=2, min_pattern_size=2, min_count=2)
    driver.add(make_request("r", [2, 3], repetition_detection=detection))
    driver.run()
    assert driver.results["r"].output_token_ids == [7, 8, 7, 8]
    assert driver.results["r"].finish_reason == "repetition"
    assert calls["r"] == [1, 2, 3, 4]
