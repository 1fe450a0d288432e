"""Bad input found by a newcomer's probing: each gets a clear ValueError, and the LLM object
keeps working afterwards (same greedy tokens as before, no leaked KV block)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate("the lazy fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("call, needle", [
    (lambda llm: llm.generate("hi", SamplingParams(logprobs=10**6)), "logprobs"),
    (lambda llm: llm.generate("hi", SamplingParams(seed=2**70)), "seed"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=float("inf"))), "temperature"),
    (lambda llm: llm.generate(None), "prompts"),
    (lambda llm: llm.generate(5), "prompts"),
    (lambda llm: llm.generate("hi", {"max_tokens": 2}), "sampling_params"),
    (lambda llm: llm.generate("caf\udce9"), "Unicode"),
    (lambda llm: llm.chat([]), "messages"),
    (lambda llm: llm.chat([{"content": "no role"}]), "role"),
])
def test_bad_input_is_a_value_error_and_the_engine_keeps_working(llm, reference, call, needle,
                                                                  assert_no_leaks):
    with pytest.raises(ValueError, match=needle):
        call(llm)
    assert llm.generate("the lazy fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        reference
    assert_no_leaks(llm)


def test_empty_prompt_list_returns_nothing(llm):
    assert llm.generate([]) == []


def test_a_failing_step_aborts_its_requests_and_the_engine_recovers(llm, reference,
                                                                      monkeypatch,
                                                                      assert_no_leaks):
    runner = llm.engine.core.executor.runner
    real = runner.launch_forward  # a step's first part, which the worker calls

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(runner, "launch_forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["the lazy fox", "a second prompt"], GREEDY, use_tqdm=False)
    monkeypatch.setattr(runner, "launch_forward", real)
    assert_no_leaks(llm)
    assert llm.generate("the lazy fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        reference


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_step_leaves_no_unwritten_kv_in_the_prefix_cache(llm, monkeypatch, error,
                                                                   assert_no_leaks):
    """A step that raised (or was interrupted) had its prompt's full blocks indexed when they
    were allocated; the same prompt afterwards must not hit them (their K/V were never
    written: it generated other tokens). Oracle: the prompt's tokens on a clean cache."""
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 2 full blocks of 16 and a part
    kv = llm.engine.core.kv_cache_manager
    kv.reset_prefix_cache()
    want = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    kv.reset_prefix_cache()
    runner = llm.engine.core.executor.runner

    def broken(*args, **kwargs):
        raise error("simulated failure")

    with monkeypatch.context() as patch:
        patch.setattr(runner, "launch_forward", broken)
        with pytest.raises(error):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async_sched"])
def test_a_failed_step_does_not_leave_enqueued_requests_hanging(tiny_model_factory,
                                                                 monkeypatch, async_scheduling,
                                                                 assert_no_leaks):
    """Was: an enqueued request scheduled in a step that raised was aborted in the core but
    not in the front end, so the next ``generate`` stepped an empty engine for ever waiting
    for it. Now the failed call raises the runner's error, the next ``generate`` gets its
    tokens at once (oracle: the same prompts before the failure), ``wait_for_completion``
    raises ``RequestFailed`` naming the cause, and no KV block or request state is left."""
    from kvflow.engine.streams import RequestFailed
    from tests.request_state import holders

    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
              async_scheduling=async_scheduling)
    prompts = ["the lazy fox", "a second prompt"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    runner = llm.engine.core.executor.runner
    real, calls = runner.launch_forward, []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "launch_forward", broken_once)
    llm.enqueue("an enqueued prompt", GREEDY)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    with pytest.raises(RequestFailed, match="RuntimeError: simulated kernel failure") as failed:
        llm.wait_for_completion(use_tqdm=False)
    assert llm.wait_for_completion(use_tqdm=False) == []
    assert_no_leaks(llm)
    assert holders(llm, [failed.value.request_id]) == []


def test_kv_cache_larger_than_memory_is_a_value_error(tiny_model_factory):
    with pytest.raises(ValueError, match="KV cache needs"):
        LLM(model=tiny_model_factory("llama").path, dtype="float32", kv_cache_memory="100TiB")
