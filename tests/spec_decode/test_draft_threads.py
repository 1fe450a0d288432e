"""The draft model's thread count: the faster candidate by measured pass times, checked on
synthetic times; the thread count really changes during a pass and is restored after; the
config rejects a bad count."""

from __future__ import annotations

import re

import pytest
import torch

from kvflow.config import SpeculativeConfig, cpu_limits
from kvflow.spec_decode.draft_threads import DraftThreads


def _drive(choice: DraftThreads, seconds: dict[int, float], n: int) -> list[int]:
    picked = []
    for _ in range(n):
        threads = choice.pick()
        picked.append(threads)
        choice.observe(seconds[threads])
    return picked


def test_measures_each_candidate_then_keeps_the_faster_and_explores():
    """Two threads 1.2 s a pass, one thread 0.13 s (a loaded machine): after one pass on
    each, one thread; a try of two threads after 2 proposals on it, then after 4, 8 (each try
    confirms the choice, so the interval doubles). Only passes on the faster count are the
    draft's cost (``picked_best``)."""
    choice = DraftThreads([2, 1], explore_every=2)
    picked, best = [], []
    for _ in range(20):
        picked.append(choice.pick())
        choice.observe({2: 1.2, 1: 0.13}[picked[-1]])
        best.append(choice.picked_best)
    tries = [i for i, t in enumerate(picked) if t == 2]
    assert tries == [0, 4, 9, 18]
    assert best == [t == 1 for t in picked]
    assert choice.explore_every == 16


def test_seeded_counts_start_on_the_faster():
    """Both counts timed before serving (two threads 1.2 s, one 0.13 s): the first pick is
    one thread and it is the draft's cost; a count that is not a candidate is refused."""
    choice = DraftThreads([2, 1], explore_every=2)
    choice.seed(2, 1.2)
    choice.seed(1, 0.13)
    assert choice.pick() == 1 and choice.picked_best
    with pytest.raises(ValueError, match="threads=3"):
        choice.seed(3, 0.1)


def test_follows_the_load_when_it_changes():
    """The machine gets quiet: two threads now 0.05 s, one thread still 0.13 s; the next try
    sees it, the choice moves to two threads and the interval starts over (2); the try of one
    thread after it keeps two (interval 4)."""
    choice = DraftThreads([2, 1], explore_every=2, smoothing=1.0)
    assert _drive(choice, {2: 1.2, 1: 0.13}, 4) == [2, 1, 1, 1]
    picked = _drive(choice, {2: 0.05, 1: 0.13}, 8)
    assert picked == [2, 2, 2, 1, 2, 2, 2, 2]
    assert choice.explore_every == 4


def test_a_proposal_without_a_steady_pass_teaches_nothing():
    choice = DraftThreads([2, 1])
    choice.pick()
    choice.observe(0.0)
    assert choice.seconds == [None, None]
    assert choice.pick() == 2  # still unmeasured


def test_a_fixed_count_is_the_only_choice():
    choice = DraftThreads([1, 1])
    assert choice.candidates == [1]
    assert _drive(choice, {1: 0.5}, 5) == [1] * 5


def test_running_sets_and_restores_the_thread_count():
    before = torch.get_num_threads()
    choice = DraftThreads([before, 1])
    with choice.running(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), choice.running(1):
        raise RuntimeError("a failed pass")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_config_rejects_a_bad_thread_count(bad):
    with pytest.raises(ValueError, match="draft_cpu_threads"):
        SpeculativeConfig(method="draft_model", model="m", draft_cpu_threads=bad)
    assert SpeculativeConfig(method="draft_model", model="m",
                             draft_cpu_threads=1).draft_cpu_threads == 1


def test_draft_threads_above_the_mask_or_the_quota_are_refused(monkeypatch):
    """The limit is --cpu-threads' (the affinity mask, capped by the cgroup CPU quota rounded
    up), here faked: a mask of 6 CPUs with a 2.5-CPU quota grants 3; a mask of 2, no quota, 2.
    The message names the field, the value, the limit and where it comes from."""
    base = {"method": "draft_model", "model": "any", "num_speculative_tokens": 2}
    monkeypatch.setattr(cpu_limits, "usable_cpus", lambda: [0, 1, 2, 3, 4, 5])
    monkeypatch.setattr(cpu_limits, "cgroup_cpu_limit", lambda: 2.5)
    assert SpeculativeConfig(**base, draft_cpu_threads=3).draft_cpu_threads == 3
    with pytest.raises(ValueError, match="^" + re.escape(
            "speculative_config draft_cpu_threads=4 exceeds the 3 CPUs this process may use "
            "(its affinity mask has 6 CPUs, its cgroup CPU quota is 2.5 CPUs): threads beyond "
            "the CPUs only wait for each other at every parallel step; give at most 3, or "
            "leave it out (the default is the faster, as measured, of the engine's count and "
            "1)") + "$"):
        SpeculativeConfig(**base, draft_cpu_threads=4)
    monkeypatch.setattr(cpu_limits, "usable_cpus", lambda: [4, 7])
    monkeypatch.setattr(cpu_limits, "cgroup_cpu_limit", lambda: None)
    assert SpeculativeConfig(**base, draft_cpu_threads=2).draft_cpu_threads == 2
    with pytest.raises(ValueError, match=re.escape(
            "speculative_config draft_cpu_threads=3 exceeds the 2 CPUs this process may use "
            "(its affinity mask has 2 CPUs): ")):
        SpeculativeConfig(**base, draft_cpu_threads=3)
