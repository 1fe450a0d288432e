"""Async scheduling against lock-step scheduling (the oracle), without a model.

The driver plays the engine core's async loop: schedule step N+1 and execute it (FakeDriver's
KV-checking execute, which reads the tokens step N sampled from its own mirror, as the runner
reads them on the device), then fold step N's tokens in. Every run must give exactly the
tokens, finish reasons and stop reasons of the same workload scheduled in lock-step, whatever
stops it: EOS or stop ids sampled while the next step is already out, max_tokens,
max_model_len, preemption in a tight pool, aborts.
"""

from __future__ import annotations

import random

import pytest

EOS = 1  # the conftest default eos_token_id


def run_async(drv, max_steps: int = 5000, abort_at: dict | None = None,
              add_at: dict | None = None) -> dict:
    """Drive ``drv.scheduler`` with one step in flight; returns what was seen. After step
    ``i`` is out, the requests ``abort_at[i]`` are aborted, then ``add_at[i]`` added."""
    sched, prev = drv.scheduler, None
    seen = {"overlaps": 0, "steps": 0, "scheduled": {}}
    for step in range(max_steps):
        if not sched.has_unfinished_requests() and prev is None:
            return seen
        out = sched.schedule()
        for rid in out.num_scheduled_tokens:
            seen["scheduled"][rid] = seen["scheduled"].get(rid, 0) + 1
        sampled = drv.execute(out)  # step N+1's forward (and, here, its sampling)
        if prev is not None:
            seen["overlaps"] += len(set(out.num_scheduled_tokens) & set(prev[0].req_ids))
            _fold_in(drv, prev[1], prev[0])
        prev = (sampled, out) if not out.is_empty else None
        for rid in (abort_at or {}).get(step, ()):
            drv.abort([rid])
        for request in (add_at or {}).get(step, ()):
            drv.add(request)
        seen["steps"] += 1
    raise AssertionError("not finished")


def _fold_in(drv, out, sampled) -> None:
    for o in drv.scheduler.update_from_output(out, sampled):
        drv.history[o.request_id].extend(o.new_token_ids)
        res = drv.results[o.request_id]
        res.output_token_ids.extend(o.new_token_ids)
        res.finish_reason, res.stop_reason = o.finish_reason, o.stop_reason
    drv.check_ref_counts()


def _results(drv) -> dict:
    return {rid: (r.output_token_ids, r.finish_reason, r.stop_reason)
            for rid, r in drv.results.items()}


def _workload(rng: random.Random, n: int) -> list[dict]:
    shared = [rng.randrange(2, 90) for _ in range(8)]
    out = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(2, 90)
                                                   for _ in range(rng.randrange(1, 14))]
        params = {"max_tokens": rng.randrange(1, 12)}
        if i % 4 == 1:
            params["stop_token_ids"] = [100 + rng.randrange(1000)]
        if i % 5 == 2:
            params["min_tokens"] = 2
        out.append({"rid": f"r{i}", "prompt": prompt, "params": params,
                    "script": [EOS if rng.random() < 0.15 else 500 + rng.randrange(50)
                               for _ in range(rng.randrange(0, 6))]})
    return out


def _run(make_scheduler, make_driver, make_request, spec, async_scheduling, **cfg):
    sched = make_scheduler(async_scheduling=async_scheduling, **cfg)
    drv = make_driver(sched, {r["rid"]: r["script"] for r in spec})
    for r in spec:
        drv.add(make_request(r["rid"], r["prompt"], **r["params"]))
    seen = run_async(drv) if async_scheduling else drv.run() and None
    return drv, seen


@pytest.mark.parametrize("cfg", [
    {"max_num_batched_tokens": 64},
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefill, admission waits
    {"num_blocks": 14, "max_num_batched_tokens": 32},  # tight pool: preemptions
    {"num_blocks": 40, "max_model_len": 18, "enable_prefix_caching": False},  # length cap
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_equals_lock_step(make_scheduler, make_driver, make_request, cfg, seed):
    spec = _workload(random.Random(seed), 10)
    if "max_model_len" in cfg:
        spec = [r for r in spec if len(r["prompt"]) < cfg["max_model_len"]]
    lock, _ = _run(make_scheduler, make_driver, make_request, spec, False, **cfg)
    drv, seen = _run(make_scheduler, make_driver, make_request, spec, True, **cfg)
    assert _results(drv) == _results(lock)
    assert seen["overlaps"] > 0  # steps really overlapped
    assert all(r.num_output_placeholders == 0 for r in drv.scheduler.requests.values())


def test_tight_pool_preempts_under_async(make_scheduler, make_driver, make_request, oracle):
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=32, async_scheduling=True)
    drv = make_driver(sched)
    prompts = {f"r{i}": list(range(3 * i + 2, 3 * i + 11)) for i in range(5)}
    for rid, prompt in prompts.items():
        drv.add(make_request(rid, prompt, max_tokens=10))
    run_async(drv)
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert drv.results[rid].output_token_ids == oracle(prompt, 10)


def test_eos_sampled_while_the_next_step_is_out(make_scheduler, make_driver, make_request):
    """The step computed after an EOS is dropped: the output ends at the EOS."""
    sched = make_scheduler(async_scheduling=True)
    drv = make_driver(sched, {"a": [7, 8, EOS, 9, 9]})
    drv.add(make_request("a", [2, 3, 4], max_tokens=10))
    seen = run_async(drv)
    assert drv.results["a"].output_token_ids == [7, 8, EOS]
    assert drv.results["a"].finish_reason == "stop" and seen["overlaps"] >= 2


def test_max_tokens_is_not_overrun(make_scheduler, make_driver, make_request, oracle):
    """A request whose pending token reaches max_tokens is not scheduled again."""
    sched = make_scheduler(async_scheduling=True)
    drv = make_driver(sched)
    drv.add(make_request("a", [2, 3, 4], max_tokens=3))
    seen = run_async(drv)
    assert drv.results["a"].output_token_ids == oracle([2, 3, 4], 3)
    # the prefill and 2 decodes, as in lock-step: no 4th step computing a token to drop
    assert seen["scheduled"]["a"] == 3


@pytest.mark.parametrize("at", [1, 2, 4])
def test_an_id_aborted_in_flight_and_added_again_gets_only_its_own_tokens(
        make_scheduler, make_driver, make_request, oracle, at):
    """"a" aborted while its step is out (its prefill's, ``at`` 1; a decode's), then a new
    request "a" of another prompt added before that step comes back: the step's token is the
    old request's, dropped; the new one's tokens are lock-step's (was: the old token was
    folded into the new request, which then held a token its prompt never gave)."""
    sched = make_scheduler(async_scheduling=True)
    drv = make_driver(sched)
    drv.add(make_request("a", [2, 3, 4], max_tokens=8))
    drv.add(make_request("b", [5, 6], max_tokens=8))
    run_async(drv, abort_at={at: ["a"]},
              add_at={at: [make_request("a", [7, 8, 9, 10, 11], max_tokens=6)]})
    assert drv.results["a"].output_token_ids == oracle([7, 8, 9, 10, 11], 6)
    assert drv.results["a"].finish_reason == "length"
    assert drv.results["b"].output_token_ids == oracle([5, 6], 8)
    assert not sched.has_unfinished_requests()


def test_abort_while_in_flight(make_scheduler, make_driver, make_request, oracle):
    sched = make_scheduler(async_scheduling=True)
    drv = make_driver(sched)
    drv.add(make_request("a", [2, 3, 4], max_tokens=8))
    drv.add(make_request("b", [5, 6], max_tokens=8))
    run_async(drv, abort_at={2: ["a"]})
    assert drv.results["a"].finish_reason == "abort"
    assert drv.results["b"].output_token_ids == oracle([5, 6], 8)
    assert not sched.has_unfinished_requests()
