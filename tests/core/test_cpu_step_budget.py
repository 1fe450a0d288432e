"""The CPU default step budget and the TTFT tail: every waiting prompt (within
``CpuPlatform.default_max_num_batched_tokens``, 2,048 tokens) goes whole into the next step
beside every running decode, rather than a few prompts per step.

On the fake clock (``tests/core/sim.py``) with a step of 50 ms + 1 ms per prefill token
(the shape fitted to kvflow bf16 on a 2-vCPU Ice Lake, 1.1 ms there; docs/benchmarks.md,
"session 53: served p99 TTFT"), the expected times are hand-computed from the rule: a step
takes the waiting prompts present when it starts, and a prompt's first token comes at the end
of the step that computes its last token. Prompts of 128 tokens (compare_cpu.sh's).
"""

from __future__ import annotations

import pytest

from kvflow.core.step_time_model import StepFeatures
from kvflow.platforms.cpu import CpuPlatform
from tests.core.sim import FakeClock, SimRequest, assert_idle, make_sim_scheduler, simulate


def step_time(f: StepFeatures) -> float:
    """50 ms a step plus 1 ms per prefill token; decode rows free."""
    return 0.050 + 0.001 * f.prefill_tokens


def _burst(budget: int):
    """a alone at 0 s, then b, c, d 10 ms apart while a's prefill step runs."""
    clock = FakeClock()
    sched = make_sim_scheduler(clock, max_num_batched_tokens=budget)
    work = [SimRequest(rid, t, 128, 4, client=rid)
            for rid, t in (("a", 0.0), ("b", 0.01), ("c", 0.02), ("d", 0.03))]
    result = simulate(work, clock, sched, step_time)
    assert_idle(sched)
    return result


def test_cpu_default_budget_takes_every_waiting_prompt_in_one_step():
    """Budget 2,048: step 1 (0-0.178 s) is a's 128 tokens; b, c and d arrive during it, and
    step 2 carries a's decode and all three prompts whole (384 prefill tokens: 0.434 s), so
    they get their first tokens together at 0.612 s: TTFTs 178, 602, 592, 582 ms."""
    budget = CpuPlatform.default_max_num_batched_tokens
    assert budget == 2048
    result = _burst(budget)
    ttft_ms = {rid: round(t.ttft * 1e3, 6) for rid, t in result.timelines.items()}
    assert ttft_ms == {"a": 178.0, "b": 602.0, "c": 592.0, "d": 582.0}
    # tokens per step by request: b, c and d each computed their prompt in one 128-token step
    for rid in "bcd":
        assert result.tokens_by_client[rid][0] == (pytest.approx(0.612), 128)
    assert result.tokens_by_client["a"][1] == (pytest.approx(0.612), 1)  # a's decode rode along


def test_a_smaller_budget_serialises_the_burst_and_lengthens_its_slowest_ttft():
    """Budget 256: step 2 takes a's decode, b's 128 tokens and 127 of c's (255 prefill
    tokens: 0.305 s, ends 0.483 s); step 3 a's decode, c's last token (a one-token row, a
    decode in the step time) and d's 128 (0.178 s, ends 0.661 s). b gains (473 ms) but c
    and d lose: the slowest TTFT is 641 ms against the default's 602."""
    result = _burst(256)
    ttft_ms = {rid: round(t.ttft * 1e3, 6) for rid, t in result.timelines.items()}
    assert ttft_ms == {"a": 178.0, "b": 473.0, "c": 641.0, "d": 631.0}
    assert [n for _, n in result.tokens_by_client["c"][:2]] == [127, 1]
    assert max(ttft_ms.values()) > max(_burst(2048).timelines[r].ttft * 1e3 for r in "abcd")
