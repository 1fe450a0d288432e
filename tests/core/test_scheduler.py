"""Scheduler: the phase-free token-budget rule, admission order, preemption, stops, aborts.

Every run goes through ``FakeDriver`` (conftest), which checks block tables, ref counts and a
simulated KV cache each step; outputs are compared with ``default_sample``'s oracle.
"""

from __future__ import annotations

import random

import pytest

from kvflow.request import RequestStatus

EOS = 1  # the conftest default eos_token_id


def scheduled_table(driver) -> list[dict[str, int]]:
    """Per step: request id -> tokens scheduled."""
    return [step.num_scheduled for step in driver.steps]


# ---- the one rule: chunks and decodes share a token budget ---------------------------------------
def test_long_prompt_is_chunked_16_16_8(make_scheduler, make_driver, make_request, oracle):
    sched = make_scheduler(max_num_batched_tokens=16)
    drv = make_driver(sched)
    prompt = list(range(2, 42))
    drv.add(make_request("a", prompt, max_tokens=3))
    res = drv.run()
    assert scheduled_table(drv) == [{"a": 16}, {"a": 16}, {"a": 8}, {"a": 1}, {"a": 1}]
    assert [s.num_computed_before["a"] for s in drv.steps] == [0, 16, 32, 40, 41]
    assert [s.do_sample["a"] for s in drv.steps] == [False, False, True, True, True]
    assert res["a"].output_token_ids == oracle(prompt, 3)
    assert res["a"].finish_reason == "length"


def test_prefill_chunks_share_steps_with_decodes(make_scheduler, make_driver, make_request,
                                                 oracle):
    """FCFS: the older short requests decode first; the 40-token prompt gets the rest."""
    sched = make_scheduler(max_num_batched_tokens=16)
    drv = make_driver(sched)
    prompts = {"b": [5, 6, 7], "c": [8, 9, 10], "a": list(range(2, 42))}
    drv.add(make_request("b", prompts["b"], max_tokens=6))
    drv.add(make_request("c", prompts["c"], max_tokens=6))
    drv.add(make_request("a", prompts["a"], max_tokens=2))
    res = drv.run()
    assert scheduled_table(drv) == [
        {"b": 3, "c": 3, "a": 10},
        {"b": 1, "c": 1, "a": 14},
        {"b": 1, "c": 1, "a": 14},
        {"b": 1, "c": 1, "a": 2},  # a's prompt done: 10 + 14 + 14 + 2 = 40, first sample
        {"b": 1, "c": 1, "a": 1},  # a's second token, then "length"
        {"b": 1, "c": 1},
    ]
    assert all(step.total <= 16 for step in drv.steps)
    for rid, prompt in prompts.items():
        n = 2 if rid == "a" else 6
        assert res[rid].output_token_ids == oracle(prompt, n)


def test_urgent_prompt_takes_budget_before_decodes(make_scheduler, make_driver, make_request):
    """Priority policy: a running urgent prompt is served first each step; decodes of the
    less urgent requests fill what is left of the 16-token budget."""
    sched = make_scheduler(max_num_batched_tokens=16, policy="priority")
    drv = make_driver(sched)
    drv.add(make_request("b", [5, 6, 7], max_tokens=8, priority=1))
    drv.add(make_request("c", [8, 9, 10], max_tokens=8, priority=1))
    drv.step()  # b, c prefill
    drv.add(make_request("a", list(range(2, 42)), max_tokens=2, priority=0))
    for _ in range(4):
        drv.step()
    assert scheduled_table(drv) == [
        {"b": 3, "c": 3},
        {"b": 1, "c": 1, "a": 14},  # a is admitted after the running requests
        {"a": 16},  # now running, a comes first and uses the whole budget
        {"a": 10, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},
    ]


def test_max_num_seqs_caps_running(make_scheduler, make_driver, make_request):
    sched = make_scheduler(max_num_seqs=2)
    drv = make_driver(sched)
    for i, n in enumerate([2, 4, 1, 1]):
        drv.add(make_request(f"r{i}", [3 + i] * 5, max_tokens=n))
    max_running = 0
    while sched.has_unfinished_requests():
        drv.step()
        max_running = max(max_running, sched.num_running)
    assert max_running == 2
    assert scheduled_table(drv) == [
        {"r0": 5, "r1": 5},
        {"r0": 1, "r1": 1},  # r0 finishes (2 tokens)
        {"r1": 1, "r2": 5},  # r2 finishes after its first token
        {"r1": 1, "r3": 5},  # r1 and r3 finish
    ]


def test_fcfs_admits_by_arrival_time(make_scheduler, make_driver, make_request):
    sched = make_scheduler(max_num_seqs=1)
    drv = make_driver(sched)
    drv.add(make_request("late", [2, 3], max_tokens=1, arrival=5.0))
    drv.add(make_request("early", [4, 5], max_tokens=1, arrival=1.0))
    drv.add(make_request("mid", [6, 7], max_tokens=1, arrival=3.0))
    drv.run()
    assert [list(s.num_scheduled) for s in drv.steps] == [["early"], ["mid"], ["late"]]


def test_fcfs_ties_keep_insertion_order(make_scheduler, make_driver, make_request):
    sched = make_scheduler(max_num_seqs=1)
    drv = make_driver(sched)
    for rid in ("x", "y", "z"):
        drv.add(make_request(rid, [2, 3], max_tokens=1, arrival=0.0))
    drv.run()
    assert [list(s.num_scheduled) for s in drv.steps] == [["x"], ["y"], ["z"]]


def test_priority_admits_lower_values_first(make_scheduler, make_driver, make_request):
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    drv = make_driver(sched)
    drv.add(make_request("p2", [2, 3], max_tokens=1, priority=2))
    drv.add(make_request("p0-late", [2, 3], max_tokens=1, priority=0))
    drv.add(make_request("p1", [2, 3], max_tokens=1, priority=1))
    drv.add(make_request("p0-later", [2, 3], max_tokens=1, priority=0))
    drv.run()
    order = [list(s.num_scheduled) for s in drv.steps]
    assert order == [["p0-late"], ["p0-later"], ["p1"], ["p2"]]


def test_unknown_policy_raises(make_scheduler):
    with pytest.raises(ValueError):
        make_scheduler(policy="lifo")


# ---- preemption --------------------------------------------------------------------------------
def _run_pair(make_scheduler, make_driver, make_request, num_blocks, caching=True):
    """Run A (older) and B: 8-token prompts, 12 output tokens each, max_model_len 24."""
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=24,
                           enable_prefix_caching=caching)
    drv = make_driver(sched)
    reqs = {"A": make_request("A", list(range(10, 18)), max_tokens=12),
            "B": make_request("B", list(range(20, 28)), max_tokens=12)}
    for r in reqs.values():
        drv.add(r)
    return sched, drv, reqs, drv.run()


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_recomputes_newest_without_losing_tokens(make_scheduler, make_driver,
                                                            make_request, oracle, caching):
    # 6 usable blocks = 24 slots; each request needs 19 (8 prompt + 11 computed outputs).
    sched, drv, reqs, res = _run_pair(make_scheduler, make_driver, make_request, 7, caching)
    assert sched.num_preemptions > 0
    preempted = [rid for step in drv.steps for rid in step.preempted]
    assert preempted[0] == "B"  # the newest request is the victim
    assert reqs["B"].num_preemptions >= 1 and reqs["A"].num_preemptions == 0
    # Step k >= 1 computes token 8 + k of each: at step 5 both need a 4th block (13 tokens),
    # the pool has none free, so B (newest) is preempted and A takes one of its blocks.
    assert [s.preempted for s in drv.steps[:6]] == [[], [], [], [], [], ["B"]]
    assert drv.steps[5].num_scheduled == {"A": 1}
    _, _, _, big = _run_pair(make_scheduler, make_driver, make_request, 1000, caching)
    for rid, req in reqs.items():
        assert res[rid].output_token_ids == big[rid].output_token_ids
        assert res[rid].output_token_ids == oracle(req.prompt_token_ids, 12)
        assert res[rid].finish_reason == "length"


def test_preempted_request_resumes_from_prefix_hits(make_scheduler, make_driver, make_request):
    sched, drv, reqs, _ = _run_pair(make_scheduler, make_driver, make_request, 8, True)
    # 7 usable blocks. Step 5: A takes the last free block, B finds none and is preempted; its
    # blocks are freed tail-first. A's 5th block (step 9) evicts B's third block only, so when B
    # comes back (step 12, after A's 12th token) its first two blocks are prefix hits.
    assert sched.num_preemptions == 1 and drv.steps[5].preempted == ["B"]
    assert [i for i, s in enumerate(drv.steps) if "B" in s.num_scheduled][5:7] == [12, 13]
    assert drv.steps[12].num_computed_before == {"B": 8}
    assert drv.steps[12].num_scheduled == {"B": 13 - 8}  # 8 prompt + 5 outputs kept
    assert reqs["B"].num_cached_tokens == 0  # hits at *first* scheduling


def test_priority_preempts_least_urgent_first(make_scheduler, make_driver, make_request,
                                              oracle):
    sched = make_scheduler(num_blocks=7, max_model_len=24, policy="priority")
    drv = make_driver(sched)
    old_lazy = make_request("lazy", list(range(10, 18)), max_tokens=12, priority=5)
    urgent = make_request("urgent", list(range(20, 28)), max_tokens=12, priority=0)
    drv.add(old_lazy)
    drv.add(urgent)
    res = drv.run()
    first = next(s for s in drv.steps if s.preempted)
    assert first.preempted == ["lazy"]
    assert urgent.num_preemptions == 0
    for req in (old_lazy, urgent):
        assert res[req.request_id].output_token_ids == oracle(req.prompt_token_ids, 12)


def test_request_preempts_itself_when_it_is_the_newest(make_scheduler, make_driver,
                                                       make_request):
    """Two requests, the pool fits one: the older keeps running, the newer waits (it is
    preempted itself if it is the one that runs out)."""
    sched = make_scheduler(num_blocks=5, max_model_len=16)
    drv = make_driver(sched)
    drv.add(make_request("A", [2] * 4, max_tokens=10))
    drv.add(make_request("B", [3] * 4, max_tokens=10))
    res = drv.run()
    assert sched.num_preemptions >= 1
    assert all(step.preempted in ([], ["B"]) for step in drv.steps)
    assert len(res["A"].output_token_ids) == 10 and len(res["B"].output_token_ids) == 10


# ---- randomized: tiny pools must give the same tokens as a huge pool -----------------------------
def _random_workload(rng: random.Random) -> list[dict]:
    """3-7 request specs whose prompts often share a prefix (so prefix hits happen)."""
    reqs = []
    shared = [rng.randint(2, 5) for _ in range(12)]
    for i in range(rng.randint(3, 7)):
        prompt = shared[:rng.randint(0, 12)] + [rng.randint(2, 5)
                                                for _ in range(rng.randint(1, 10))]
        reqs.append({"rid": f"r{i}", "prompt": prompt[:20], "max_tokens": rng.randint(1, 14),
                     "priority": rng.randint(0, 2), "arrival": float(rng.randint(0, 3))})
    return reqs


def _run_workload(make_scheduler, make_driver, make_request, spec, **cfg):
    """Run a workload spec to completion under ``cfg``; returns (scheduler, results)."""
    sched = make_scheduler(max_model_len=32, **cfg)
    drv = make_driver(sched)
    for r in spec:
        drv.add(make_request(r["rid"], r["prompt"], max_tokens=r["max_tokens"],
                             priority=r["priority"], arrival=r["arrival"]))
    return sched, drv.run()


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_match_huge_pool(make_scheduler, make_driver, make_request, oracle,
                                          seed):
    rng = random.Random(seed)
    spec = _random_workload(rng)
    bs = rng.choice([1, 2, 4, 4, 8])
    min_blocks = 32 // bs + 1  # max_model_len (32 tokens) must fit, plus the null block
    cfg = {"block_size": bs, "num_blocks": rng.randint(min_blocks, 2 * min_blocks),
           "max_num_batched_tokens": rng.randint(1, 24),
           "max_num_seqs": rng.randint(1, 5), "policy": rng.choice(["fcfs", "priority"]),
           "enable_prefix_caching": rng.random() < 0.7}
    _, res = _run_workload(make_scheduler, make_driver, make_request, spec, **cfg)
    big_cfg = dict(cfg, num_blocks=1000, max_num_batched_tokens=4096, max_num_seqs=256)
    _, big = _run_workload(make_scheduler, make_driver, make_request, spec, **big_cfg)
    for r in spec:
        n = min(r["max_tokens"], 32 - len(r["prompt"]))
        assert res[r["rid"]].output_token_ids == oracle(r["prompt"], n), (r, cfg)
        assert big[r["rid"]].output_token_ids == res[r["rid"]].output_token_ids
        assert res[r["rid"]].finish_reason == "length"


def test_random_workloads_do_preempt(make_scheduler, make_driver, make_request):
    """The randomized runs above must actually exercise preemption (guard against a vacuous
    test): on tiny pools with big budgets, most of them preempt."""
    count = 0
    for seed in range(10):
        rng = random.Random(1000 + seed)
        spec = _random_workload(rng)
        sched, _ = _run_workload(make_scheduler, make_driver, make_request, spec,
                                 num_blocks=9, max_num_batched_tokens=64)
        count += sched.num_preemptions > 0
    assert count >= 5


# ---- finishing: abort, stop conditions -----------------------------------------------------------
def test_abort_running_and_waiting_frees_blocks_now(make_scheduler, make_driver, make_request):
    sched = make_scheduler(num_blocks=11, max_num_seqs=2)
    drv = make_driver(sched)
    drv.add(make_request("run1", list(range(2, 11)), max_tokens=10))  # 9 tokens: 3 blocks
    drv.add(make_request("run2", list(range(2, 6)), max_tokens=10))  # 4 tokens: 1 block
    drv.add(make_request("wait", list(range(2, 6)), max_tokens=10))
    drv.step()
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert sched.kv.num_free_blocks == 10 - 4
    run1_blocks = sched.kv.get_block_ids("run1")[0]
    drv.abort(["run1", "wait", "no-such-request"])
    assert sched.kv.num_free_blocks == 10 - 1 and sched.kv.get_block_ids("run1")[0] == []
    assert all(sched.kv.pool.blocks[b].ref_cnt == 0 for b in run1_blocks)
    assert sched.num_running == 1 and sched.num_waiting == 0
    assert set(sched.requests) == {"run2"}
    rec = drv.step()
    assert rec.finished_ids == {"run1", "wait"}
    assert rec.num_scheduled == {"run2": 1}
    drv.abort(["run2"])
    assert sched.kv.num_free_blocks == 10 and not sched.has_unfinished_requests()


def test_abort_preempted_request(make_scheduler, make_driver, make_request):
    sched = make_scheduler(num_blocks=7, max_model_len=24)
    drv = make_driver(sched)
    drv.add(make_request("A", list(range(10, 18)), max_tokens=12))
    b = make_request("B", list(range(20, 28)), max_tokens=12)
    drv.add(b)
    while not sched.num_preemptions:
        drv.step()
    assert b.status == RequestStatus.PREEMPTED
    drv.abort(["B"])
    assert b.status == RequestStatus.FINISHED_ABORTED and sched.num_waiting == 0
    res = drv.run()
    assert len(res["A"].output_token_ids) == 12


def test_abort_between_schedule_and_update(make_scheduler, make_driver, make_request):
    sched = make_scheduler()
    drv = make_driver(sched)
    r = make_request("r", [2, 3, 4], max_tokens=5)
    drv.add(r)
    out = sched.schedule()
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    sampled = drv.execute(out)
    assert sched.update_from_output(out, sampled) == []
    assert r.output_token_ids == [] and sched.kv.num_free_blocks == 999


def test_duplicate_request_id_rejected(make_scheduler, make_request):
    sched = make_scheduler()
    sched.add_request(make_request("r", [2, 3]))
    with pytest.raises(ValueError):
        sched.add_request(make_request("r", [4, 5]))


def _run_scripted(make_scheduler, make_driver, make_request, script, **kw):
    """Run one request "r" (prompt [2, 3, 4]) whose outputs follow ``script``."""
    sched = make_scheduler(max_model_len=kw.pop("max_model_len", None))
    drv = make_driver(sched, {"r": script})
    drv.add(make_request("r", [2, 3, 4], **kw))
    return drv.run()["r"]


def test_stop_on_eos(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [7, 8, EOS, 9])
    assert res.output_token_ids == [7, 8, EOS]
    assert (res.finish_reason, res.stop_reason) == ("stop", None)


def test_stop_token_ids_set_stop_reason(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [7, 42, 8],
                        stop_token_ids=[42, 43])
    assert res.output_token_ids == [7, 42]
    assert (res.finish_reason, res.stop_reason) == ("stop", 42)


def test_ignore_eos_runs_to_max_tokens(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [EOS, 7, EOS, EOS],
                        ignore_eos=True, max_tokens=4)
    assert res.output_token_ids == [EOS, 7, EOS, EOS]
    assert (res.finish_reason, res.stop_reason) == ("length", None)


def test_ignore_eos_still_honours_stop_token_ids(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [EOS, 42, 7],
                        ignore_eos=True, stop_token_ids=[42])
    assert res.output_token_ids == [EOS, 42]
    assert (res.finish_reason, res.stop_reason) == ("stop", 42)


def test_min_tokens_defers_eos_and_stop_ids(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [EOS, 42, EOS, EOS, 7],
                        min_tokens=3, stop_token_ids=[42])
    # Tokens 1-3 may not stop (min_tokens=3); the 4th, EOS, does.
    assert res.output_token_ids == [EOS, 42, EOS, EOS]
    assert res.finish_reason == "stop" and res.stop_reason is None
    res = _run_scripted(make_scheduler, make_driver, make_request, [7, 8, 42, 9],
                        min_tokens=2, stop_token_ids=[42])
    assert res.output_token_ids == [7, 8, 42] and res.stop_reason == 42


def test_eos_on_last_allowed_token_is_stop(make_scheduler, make_driver, make_request):
    res = _run_scripted(make_scheduler, make_driver, make_request, [7, EOS], max_tokens=2)
    assert res.output_token_ids == [7, EOS] and res.finish_reason == "stop"


def test_max_tokens_finishes_with_length(make_scheduler, make_driver, make_request, oracle):
    res = _run_scripted(make_scheduler, make_driver, make_request, [], max_tokens=5)
    assert res.output_token_ids == oracle([2, 3, 4], 5)
    assert (res.finish_reason, res.stop_reason) == ("length", None)


def test_max_model_len_finishes_with_length(make_scheduler, make_driver, make_request, oracle):
    res = _run_scripted(make_scheduler, make_driver, make_request, [], max_tokens=100,
                        max_model_len=10)
    assert res.output_token_ids == oracle([2, 3, 4], 7)  # 3 prompt + 7 = max_model_len
    assert res.finish_reason == "length"


def test_finished_ids_are_reported_next_step(make_scheduler, make_driver, make_request):
    sched = make_scheduler()
    drv = make_driver(sched)
    drv.add(make_request("short", [2, 3], max_tokens=1))
    drv.add(make_request("long", [2, 3], max_tokens=3))
    first = drv.step()
    assert [o.finish_reason for o in first.outputs] == ["length", None]
    assert drv.step().finished_ids == {"short"}
    assert drv.step().finished_ids == set()


# ---- prefix caching through the scheduler ------------------------------------------------------
def test_prefix_cached_request_starts_at_hit_length(make_scheduler, make_driver, make_request,
                                                    oracle):
    sched = make_scheduler()
    drv = make_driver(sched)
    base = list(range(50, 62))  # 12 tokens = 3 blocks
    drv.add(make_request("first", base, max_tokens=2))
    drv.run()
    drv.add(make_request("second", base + [7, 8, 9], max_tokens=2))
    rec = drv.step()
    assert rec.num_computed_before == {"second": 12}
    assert rec.num_scheduled == {"second": 3}
    res = drv.run()
    assert res["second"].num_cached_tokens == 12
    assert res["second"].output_token_ids == oracle(base + [7, 8, 9], 2)
    assert sched.kv.num_hits == 12 and sched.kv.num_queries == 12 + 15


def test_same_step_prefix_hit(make_scheduler, make_driver, make_request, oracle):
    """A request admitted in the same step as an identical prompt hits its blocks at once."""
    sched = make_scheduler()
    drv = make_driver(sched)
    prompt = list(range(50, 62))
    drv.add(make_request("a", prompt, max_tokens=3))
    drv.add(make_request("b", prompt, max_tokens=3))
    rec = drv.step()
    assert rec.num_computed_before == {"a": 0, "b": 8}
    assert rec.num_scheduled == {"a": 12, "b": 4}
    a_ids, b_ids = sched.kv.get_block_ids("a")[0], sched.kv.get_block_ids("b")[0]
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2]
    res = drv.run()
    assert res["a"].output_token_ids == res["b"].output_token_ids == oracle(prompt, 3)


def test_siblings_share_prompt_without_prefix_caching(make_scheduler, make_driver,
                                                      make_request, oracle):
    sched = make_scheduler(enable_prefix_caching=False)
    drv = make_driver(sched)
    prompt = list(range(50, 63))  # 13 tokens
    for i in range(3):
        drv.add(make_request(f"p-{i}", prompt, max_tokens=2, parent_id="p", sample_index=i,
                             arrival=0.0))
    drv.add(make_request("q", prompt, max_tokens=2, arrival=0.0))
    rec = drv.step()
    assert rec.num_computed_before == {"p-0": 0, "p-1": 12, "p-2": 12, "q": 0}
    shared = sched.kv.get_block_ids("p-0")[0][:3]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in shared] == [3, 3, 3]
    assert not set(sched.kv.get_block_ids("q")[0]) & set(shared)
    res = drv.run()
    assert {tuple(r.output_token_ids) for r in res.values()} == {tuple(oracle(prompt, 2))}


@pytest.mark.parametrize("seed", range(20))
def test_random_arrivals_aborts_and_siblings(make_scheduler, make_driver, make_request, oracle,
                                             seed):
    """Requests (some ``n > 1`` sibling groups) arrive over time and some are aborted; the KV
    checks run every step, aborted outputs are a prefix of the oracle's, others all of it."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(9, 14), max_model_len=32,
                           max_num_batched_tokens=rng.randint(2, 20),
                           max_num_seqs=rng.randint(1, 6), policy=rng.choice(["fcfs", "priority"]),
                           enable_prefix_caching=rng.random() < 0.5)
    drv = make_driver(sched)
    shared = [rng.randint(2, 4) for _ in range(12)]
    prompts, aborted, t = {}, set(), 0.0
    for step in range(400):
        if step < 40 and rng.random() < 0.3:
            prompt = shared[:rng.randint(0, 12)] + [rng.randint(2, 4)
                                                    for _ in range(rng.randint(1, 8))]
            n, t, max_tokens = rng.choice([1, 1, 2, 3]), t + 1.0, rng.randint(1, 12)
            for i in range(n):
                rid = f"s{step}" if n == 1 else f"s{step}-{i}"
                prompts[rid] = (prompt, min(max_tokens, 32 - len(prompt)))
                drv.add(make_request(rid, prompt, max_tokens=max_tokens, arrival=t,
                                     priority=rng.randint(0, 1), parent_id=f"s{step}",
                                     sample_index=i))
        if sched.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.requests))
            aborted.add(victim)
            drv.abort([victim])
        if step >= 40 and not sched.has_unfinished_requests():
            break
        drv.step()
    assert not sched.has_unfinished_requests()
    for rid, (prompt, num_out) in prompts.items():
        res = drv.results[rid]
        if rid in aborted:
            assert res.finish_reason == "abort"
            assert res.output_token_ids == oracle(prompt, len(res.output_token_ids))
        else:
            assert res.finish_reason == "length"
            assert res.output_token_ids == oracle(prompt, num_out)
