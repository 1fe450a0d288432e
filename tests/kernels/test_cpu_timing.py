"""kvflow/kernels/cpu_timing.alternating_cpu_seconds against a faked CPU clock: the order of
the calls (warm-ups, then passes alternating), the minimum pass per call, the zero-tick floor,
and torch's thread count restored (also after a raising call)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cpu_timing


def test_passes_alternate_and_the_fastest_pass_per_call_is_kept(monkeypatch):
    clock = {"now": 0.0}
    order: list[str] = []
    costs = {"a": iter([0.0, 3.0, 2.0, 2.0, 2.0, 5.0, 5.0]),  # warm-up, then 3 passes of 2 calls
             "b": iter([0.0, 1.0, 1.0, 4.0, 4.0, 0.5, 1.5])}

    def call(name):
        def run():
            order.append(name)
            clock["now"] += next(costs[name])
        return run

    monkeypatch.setattr(cpu_timing.time, "process_time", lambda: clock["now"])
    seen_threads = []
    got = cpu_timing.alternating_cpu_seconds(
        lambda: seen_threads.append(torch.get_num_threads()) or {"a": call("a"), "b": call("b")},
        repeats=3, per_pass=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert got == {"a": pytest.approx(2.0), "b": pytest.approx(1.0)}  # (2+2)/2, (0.5+1.5)/2
    assert seen_threads == [1]  # the calls are built and run on one thread


def test_a_pass_below_the_clock_tick_counts_as_1e_9_and_threads_are_restored(monkeypatch):
    monkeypatch.setattr(cpu_timing.time, "process_time", lambda: 7.0)  # the clock never moves
    threads = torch.get_num_threads()
    assert cpu_timing.alternating_cpu_seconds(lambda: {"x": lambda: None}, repeats=2) == \
        {"x": 1e-9}
    assert torch.get_num_threads() == threads

    def broken():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        cpu_timing.alternating_cpu_seconds(lambda: {"x": broken}, repeats=1)
    assert torch.get_num_threads() == threads
