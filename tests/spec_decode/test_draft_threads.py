"""The draft model's thread count: the faster candidate by measured pass times, checked on
synthetic times; the thread count really changes during a pass and is restored after; the
config rejects a bad count."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import SpeculativeConfig
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
    each, one thread, except every 4th proposal, which re-measures two."""
    choice = DraftThreads([2, 1], explore_every=4)
    picked = _drive(choice, {2: 1.2, 1: 0.13}, 12)
    assert picked[:2] == [2, 1]
    assert picked[2:] == [1, 2, 1, 1, 1, 2, 1, 1, 1, 2]


def test_follows_the_load_when_it_changes():
    """The machine gets quiet: two threads now 0.05 s, one thread still 0.13 s; the
    exploring proposals see it and the choice moves to two threads."""
    choice = DraftThreads([2, 1], explore_every=4, smoothing=1.0)
    _drive(choice, {2: 1.2, 1: 0.13}, 6)
    picked = _drive(choice, {2: 0.05, 1: 0.13}, 8)
    # proposal 7 re-measures two threads; from then on two, one thread re-measured at 11
    assert picked == [1, 2, 2, 2, 2, 1, 2, 2]


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
