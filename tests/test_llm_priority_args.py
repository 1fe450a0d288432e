"""``LLM.generate``'s per-prompt ``priority`` / ``user`` lists: what is kept and what is
refused with a ValueError naming the argument (hand-written expectations); the engines'
own ``add_request`` (``LLMEngine``, ``AsyncLLM``) refuse a priority their policy ignores
as ``LLM`` and the server do."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, SchedulerConfig
from kvflow.offline.arguments import check_priorities, check_users


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


def test_scheduler_config_checks_a_priority_against_its_policy():
    for policy in ("priority", "fair"):
        for priority in (-3, 0, 7):
            SchedulerConfig(policy=policy).check_priority(priority)  # read: accepted
    SchedulerConfig(policy="fcfs").check_priority(0)  # the default of every request
    with pytest.raises(ValueError, match=r"^priority=-1 needs the priority or fair scheduling "
                       r"policy \(policy='priority' or 'fair'\); this engine runs 'fcfs'$"):
        SchedulerConfig(policy="fcfs").check_priority(-1)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_llm_engine_add_request_refuses_a_priority_fcfs_ignores(tiny_llama, policy):
    """``LLMEngine.add_request(priority=1)`` under FCFS was queued with its priority
    silently ignored (``LLM.generate`` and the server refuse it); now a ValueError, nothing
    queued. Under the priority policy it is queued and runs."""
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=16, block_size=4,
              policy=policy)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=2)
    if policy == "fcfs":
        with pytest.raises(ValueError, match=r"priority=1 needs the priority or fair "
                           r"scheduling policy"):
            engine.add_request([5, 6, 7], params, request_id="urgent", priority=1)
        assert not engine.has_unfinished_requests()
        assert not engine.core.scheduler.requests
        engine.add_request([5, 6, 7], params, request_id="plain", priority=0)
    else:
        engine.add_request([5, 6, 7], params, request_id="urgent", priority=1)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2]


@pytest.mark.timeout(300)
def test_async_llm_refuses_a_priority_fcfs_ignores(tiny_llama):
    """``AsyncLLM.add_request`` / ``add_pooling_request`` with ``priority=2`` under FCFS:
    a ValueError before anything is queued (they queued it, the priority ignored)."""
    from kvflow.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama.path, dtype="float32",
                                               num_kv_blocks=16, block_size=4))

    async def scenario() -> None:
        await engine.start()
        try:
            with pytest.raises(ValueError, match=r"priority=2 needs the priority or fair"):
                engine.add_request("a", None, [5, 6, 7], SamplingParams(max_tokens=2),
                                   priority=2)
            with pytest.raises(ValueError, match=r"priority=2 needs the priority or fair"):
                engine.add_pooling_request("b", None, [5, 6, 7], priority=2)
            assert engine.num_waiting_requests == 0
        finally:
            await engine.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        engine.close()
