"""``LLM.generate``'s per-prompt ``priority`` / ``user`` lists: what is kept and what is
refused with a ValueError naming the argument (hand-written expectations)."""

from __future__ import annotations

import pytest

from kvflow.llm_inputs import check_priorities, check_users


def test_priorities_kept_per_prompt_and_defaulted():
    assert check_priorities([2, 0, -1], 3, "priority") == [2, 0, -1]
    assert check_priorities((1, 1), 2, "fair") == [1, 1]
    assert check_priorities(None, 3, "fcfs") == [0, 0, 0]
    assert check_priorities([0, 0], 2, "fcfs") == [0, 0]  # all zero: nothing ignored
    # one integer is every prompt's (vLLM's LLM.generate / chat take int | Sequence[int];
    # it was refused)
    assert check_priorities(3, 2, "priority") == [3, 3]
    assert check_priorities(0, 3, "fcfs") == [0, 0, 0]


@pytest.mark.parametrize("priority", [True, 1.5, [1], [1, "2"], [True, 1], "12"])
def test_priority_that_is_not_one_int_per_prompt_is_a_value_error(priority):
    with pytest.raises(ValueError, match=r"priority must be an integer or a list of 2 "
                       r"integers \(one per prompt\), got "):
        check_priorities(priority, 2, "priority")


def test_priority_under_fcfs_is_refused_and_users_need_fair():
    with pytest.raises(ValueError, match=r"needs the priority or fair scheduling policy"):
        check_priorities([1, 0], 2, "fcfs")
    with pytest.raises(ValueError, match=r"needs the priority or fair scheduling policy"):
        check_priorities(1, 2, "fcfs")
    assert check_users(["a", "b"], 2, "fair") == ["a", "b"]
    with pytest.raises(ValueError, match=r"user must be a list of 2 strings"):
        check_users("ab", 2, "fair")
    with pytest.raises(ValueError, match=r"needs the fair scheduling policy"):
        check_users(["a", "b"], 2, "priority")
